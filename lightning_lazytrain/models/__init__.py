"""Model families the streaming engine knows (where the embedding, decoder layers, final norm and head live), and
which model of a LightningModule is streamed."""

from lightning_lazytrain.models.adapter import ModelAdapter, UnsupportedModelError, adapter_for, supported_architectures
from lightning_lazytrain.models.discovery import ModelNotFoundError, find_hf_model

__all__ = [
    "ModelAdapter",
    "ModelNotFoundError",
    "UnsupportedModelError",
    "adapter_for",
    "find_hf_model",
    "supported_architectures",
]
