"""A bitsandbytes 4-bit base (QLoRA): the linear layers of the decoder layers as ``bnb.nn.Linear4bit``.

Each ``nn.Linear`` of a decoder layer is replaced by a ``Linear4bit`` holding its weight quantized by bitsandbytes
(NF4 or FP4 codes, blocks of 64, with the absmax itself 8-bit quantized: ``compress_statistics``, as
transformers' ``BitsAndBytesConfig(bnb_4bit_use_double_quant=True)``); biases stay as they are. The embedding,
the final norm and the head keep their dtype, as bitsandbytes' own loader leaves the head. A layer is quantized on
its own, so a caller going layer by layer holds one layer's full-precision weights at a time. bitsandbytes is the
``lora`` extra.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn

QuantType = Literal["nf4", "fp4"]
QUANT_TYPES: tuple[str, ...] = ("nf4", "fp4")


def quantized_linear(linear: nn.Linear, quant_type: QuantType, compute_dtype: torch.dtype | None) -> nn.Module:
    """``linear`` as a frozen ``bnb.nn.Linear4bit`` on the CPU whose weight bitsandbytes quantized from it, on the
    device that weight is on (a CUDA weight with bitsandbytes' CUDA kernels: minutes faster for a large model); the
    packed codes and their quant state are then moved to the host."""
    import bitsandbytes as bnb

    if quant_type not in QUANT_TYPES:
        raise ValueError(f"quantize must be one of {QUANT_TYPES}, got {quant_type!r}")
    has_bias = linear.bias is not None
    out = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype,
                            compress_statistics=True, quant_type=quant_type, device="meta")
    weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=True,
                               quant_type=quant_type, module=out)
    weight = weight.to(linear.weight.device)  # bitsandbytes quantizes on its first move to a device
    if weight.device.type != "cpu":
        weight = weight.to("cpu")  # moves the quant state too (the module's reference is that same object)
    out.weight = weight
    if has_bias:
        out.bias = nn.Parameter(linear.bias.data.to("cpu"), requires_grad=False)
    return out


def quantize_layer(layer: nn.Module, quant_type: QuantType, compute_dtype: torch.dtype | None = None) -> int:
    """Replace every ``nn.Linear`` inside ``layer`` by its 4-bit form; returns how many were replaced."""
    targets = [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear]
    for parent, name, child in targets:
        setattr(parent, name, quantized_linear(child, quant_type, compute_dtype))
    return len(targets)


def mark_4bit(model: nn.Module) -> None:
    """Say on ``model`` what transformers says of a model it loaded in 4 bits: peft reads it to wrap the 4-bit
    layers with its own 4-bit LoRA layers (whose merge dequantizes the base)."""
    model.is_loaded_in_4bit = True


def quantize_layers(layers: Iterable[nn.Module], quant_type: QuantType,
                    compute_dtype: torch.dtype | None = None) -> int:
    """:func:`quantize_layer` over ``layers``, one after the other; returns the linear layers replaced."""
    return sum(quantize_layer(layer, quant_type, compute_dtype) for layer in layers)


def is_4bit_linear(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit" and hasattr(module.weight, "quant_state")


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """A ``Linear4bit``'s weight as bitsandbytes dequantizes it (the dtype it was quantized from)."""
    import bitsandbytes.functional as F

    return F.dequantize_4bit(module.weight.data, module.weight.quant_state)


def full_precision_linear(module: nn.Module, weight: torch.Tensor, dtype: torch.dtype) -> nn.Linear:
    """An ``nn.Linear`` with ``weight`` (out x in) and ``module``'s bias, in ``dtype``: a 4-bit layer undone."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=module.bias is not None, dtype=dtype, device="meta")
    out.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if module.bias is not None:
        out.bias = nn.Parameter(module.bias.data.to(dtype), requires_grad=False)
    return out
