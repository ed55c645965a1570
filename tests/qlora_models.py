"""Tiny peft-wrapped models over a bitsandbytes 4-bit base, for the QLoRA tests."""

from __future__ import annotations

import torch
from helpers import tiny_model
from peft import LoraConfig, get_peft_model

from lightning_lazytrain.models.quantize import mark_4bit, quantize_layers


def tiny_4bit(quant_type: str = "nf4", seed: int = 0, compute_dtype: torch.dtype | None = None):
    """A tiny Qwen2 whose decoder layers' linear layers are bitsandbytes 4-bit (the same bytes for the same seed)."""
    base = tiny_model("qwen2", seed=seed)
    quantize_layers(base.model.layers, quant_type, compute_dtype)
    mark_4bit(base)
    return base


def tiny_qlora(quant_type: str = "nf4", r: int = 4, targets: tuple[str, ...] = ("q_proj", "v_proj"), seed: int = 0,
               compute_dtype: torch.dtype | None = None):
    """A tiny Qwen2 whose decoder layers' linear layers are bitsandbytes 4-bit, with LoRA on ``targets``; B starts
    random, so the first step already moves A and the adapted model differs from its base."""
    base = tiny_4bit(quant_type, seed, compute_dtype)
    torch.manual_seed(seed + 1)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False)
    return get_peft_model(base, config)


def packed_base(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed codes and quant-state tensors, by name, as copies."""
    out = {}
    for name, param in model.named_parameters():
        state = getattr(param, "quant_state", None)
        if state is None:
            continue
        out[name] = param.data.clone()
        out[name + ".absmax"] = state.absmax.clone()
        out[name + ".nested_absmax"] = state.state2.absmax.clone()
    return out
