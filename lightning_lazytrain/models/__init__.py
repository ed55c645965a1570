"""Model families the streaming engine knows: where the embedding, decoder layers, final norm and head live."""

from lightning_lazytrain.models.adapter import ModelAdapter, UnsupportedModelError, adapter_for, supported_architectures

__all__ = ["ModelAdapter", "UnsupportedModelError", "adapter_for", "supported_architectures"]
