"""What a model over a frozen base holds per parameter kind, for the plan: trainable and frozen parameters, and the
bytes of a 4-bit (QLoRA) base as lazytrain's store lays them out.

The plan builds the model on the meta device, where bitsandbytes cannot quantize; ``quantize`` says which weights
the run will hold as 4-bit codes: the frozen weight of every ``nn.Linear`` of a decoder layer
(``models/quantize.py`` replaces exactly those; peft's adapters are ``nn.Linear`` too but train). Their bytes follow
the store's layout (``engine/weights/layout.py``): trainable, then frozen parameters, then each 4-bit region 16-byte
aligned, the unit rounded up to 16 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_lazytrain.engine.weights.layout import aligned_numel
from lightning_lazytrain.engine.weights.packed4bit import packed_4bit_nbytes


@dataclass(frozen=True)
class BaseCounts:
    trainable_params: int
    frozen_params: int  # frozen, held in the stream dtype
    frozen_4bit_params: int  # frozen, held as 4-bit codes
    frozen_4bit_bytes: int  # what the store holds for those (codes, quant state, alignment)
    layer_stream_bytes: list[int]  # each decoder layer's streamed bytes (its weight slot's need)

    @property
    def model_params(self) -> int:
        return self.trainable_params + self.frozen_params + self.frozen_4bit_params


def _distinct(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())


def _quantized(layer: nn.Module) -> set[int]:
    return {id(m.weight) for m in layer.modules() if type(m) is nn.Linear and not m.weight.requires_grad}


def count_base(model: nn.Module, layers: list[nn.Module], stream_dtype: torch.dtype, quantize: str) -> BaseCounts:
    """Counts for ``model`` whose decoder layers are ``layers``; ``quantize``: ``none``, ``nf4`` or ``fp4``."""
    itemsize = stream_dtype.itemsize
    four_bit: set[int] = set()
    stream_bytes = []
    for layer in layers:
        quantized = _quantized(layer) if quantize != "none" else set()
        four_bit |= quantized
        params = _distinct(layer)
        plain = sum(p.numel() for p in params if id(p) not in quantized)
        if quantized:
            numel = plain
            for p in params:
                if id(p) in quantized:
                    numel = aligned_numel(numel, itemsize) + -(-packed_4bit_nbytes(p.numel()) // itemsize)
            plain = aligned_numel(numel, itemsize)
        stream_bytes.append(plain * itemsize)
    params = _distinct(model)
    packed = [p for p in params if id(p) in four_bit]
    plain_frozen = sum(p.numel() for p in params if not p.requires_grad and id(p) not in four_bit)
    plain_layers = sum(p.numel() for layer in layers for p in _distinct(layer) if id(p) not in four_bit)
    packed_bytes = sum(stream_bytes) - plain_layers * itemsize if packed else 0
    return BaseCounts(sum(p.numel() for p in params if p.requires_grad), plain_frozen, sum(p.numel() for p in packed),
                      packed_bytes, stream_bytes)
