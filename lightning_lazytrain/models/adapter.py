"""One adapter per decoder family.

Every supported family shares the HF layout ``model.model.{embed_tokens, layers, norm, rotary_emb}`` and
``model.lm_head``; what differs is which layer kinds exist (``config.layer_types``) and which config knobs
would change training semantics in ways the streamed executor does not reproduce (the router aux loss).
The engine never runs HF's decoder loop itself: it lets the model's own forward build masks, rotary tables and
position ids (so every transformers version and family gets them exactly right) and intercepts the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


class UnsupportedModelError(ValueError):
    """The model is not one of the decoder families the streaming engine supports."""


@dataclass(frozen=True)
class FamilySpec:
    architecture: str
    model_type: str
    hybrid: bool = False
    moe: bool = False


_FAMILIES: dict[str, FamilySpec] = {
    spec.architecture: spec
    for spec in (
        FamilySpec("Qwen2ForCausalLM", "qwen2"),
        FamilySpec("Qwen3ForCausalLM", "qwen3"),
        FamilySpec("Qwen3MoeForCausalLM", "qwen3_moe", moe=True),
        FamilySpec("Qwen3NextForCausalLM", "qwen3_next", hybrid=True, moe=True),
        FamilySpec("Qwen3_5ForCausalLM", "qwen3_5_text", hybrid=True),
        FamilySpec("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text", hybrid=True, moe=True),
        FamilySpec("LlamaForCausalLM", "llama"),
    )
}


def supported_architectures() -> list[str]:
    return sorted(_FAMILIES)


@dataclass
class ModelAdapter:
    """Where the pieces of one causal LM are, and the per-layer facts the engine needs."""

    model: nn.Module
    family: FamilySpec

    @property
    def decoder(self) -> nn.Module:
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def embed(self) -> nn.Module:
        return self.decoder.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def rotary(self) -> nn.Module:
        return self.decoder.rotary_emb

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def layer_types(self) -> list[str]:
        types = getattr(self.model.config, "layer_types", None)
        return list(types) if types else ["full_attention"] * self.num_layers


def adapter_for(model: nn.Module) -> ModelAdapter:
    """Return the adapter for ``model`` or raise a message naming the architecture and the supported list."""
    name = type(model).__name__
    family = _FAMILIES.get(name)
    if family is None:
        raise UnsupportedModelError(
            f"lazytrain cannot stream {name} (model_type={getattr(getattr(model, 'config', None), 'model_type', '?')})."
            f" Supported architectures: {', '.join(supported_architectures())}."
        )
    config = model.config
    if family.moe and getattr(config, "output_router_logits", False):
        raise UnsupportedModelError(
            f"{name} has output_router_logits=True: the router auxiliary loss is not streamed yet."
            " Set config.output_router_logits=False."
        )
    if len(model.model.layers) != config.num_hidden_layers:
        raise UnsupportedModelError(
            f"{name} has {len(model.model.layers)} layer modules but config.num_hidden_layers="
            f"{config.num_hidden_layers}; lazytrain streams every layer module and needs the two to agree."
        )
    return ModelAdapter(model=model, family=family)
