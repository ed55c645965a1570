"""Tiny peft-wrapped models over a bitsandbytes 4-bit base, for the QLoRA tests."""

from __future__ import annotations

import torch
from helpers import tiny_model
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config

from lightning_lazytrain.models.quantize import mark_4bit, quantize_layers

#: a tiny Qwen2 for the layer-by-layer builds (``models/layerwise.py``), its layers' linear weights 64-aligned
BUILD_LAYERS = 4
BUILD_SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=BUILD_LAYERS,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def build_config() -> Qwen2Config:
    """The config of `BUILD_SHAPE`."""
    return Qwen2Config(**BUILD_SHAPE)


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


def host_only(model: torch.nn.Module) -> bool:
    """Every parameter, buffer and 4-bit quant-state tensor of ``model`` is on the CPU."""
    tensors = [*model.parameters(), *model.buffers()]
    states = [p.quant_state for p in model.parameters() if getattr(p, "quant_state", None) is not None]
    tensors += [t for s in states for t in (s.absmax, s.code, s.state2.absmax, s.state2.code)]
    return all(t.device.type == "cpu" for t in tensors)
