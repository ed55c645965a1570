"""The flat layout of a unit: which parameters it holds and where each sits in its flat buffers.

A *unit* is what moves as one piece: one decoder layer, or the resident set (embedding, final norm, head). A
``ParamUnit`` describes only that layout and its two host buffers; which version of the weights they hold and
whether an update is still writing them is ``versions.WeightVersions``'s, and the per-unit gradient state belongs
to the run's sink (``engine/grads/``).

The parameters that train come first in the flat layout, the frozen ones after them (``trainable_numel`` marks
the border), so the masters, gradients and optimizer states of a unit cover one prefix of it and a frozen base
(LoRA) is held once, as its streamed copy. A bitsandbytes 4-bit weight (QLoRA) comes last, as bytes: its region
holds its packed codes and quant state (``packed4bit.py``), so its ``numel`` counts elements of the flat buffer,
not of the parameter. Which parameters train is read once, at setup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lazytrain.engine.weights.packed4bit import Packed4bit, is_packed_4bit

_PACKED_ALIGN = 16  # bytes: where a 4-bit parameter's region starts in a flat buffer (its parts' views align)


def aligned_numel(numel: int, itemsize: int) -> int:
    """``numel`` rounded up to whole 16-byte blocks: where flat buffers laid end to end start, so the 4-bit
    regions inside each keep their alignment."""
    step = max(_PACKED_ALIGN // itemsize, 1)
    return -(-numel // step) * step


@dataclass
class ParamEntry:
    module: nn.Module
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    uid: int
    packed: Packed4bit | None = None  # a 4-bit weight: where its codes and quant state sit in its region

    def view_in(self, flat: torch.Tensor) -> torch.Tensor:
        """This parameter as it is run, over its place in a flat buffer (the host copy or a device slot)."""
        region = flat[self.offset : self.offset + self.numel]
        return region.view(self.shape) if self.packed is None else self.packed.view(region)


@dataclass
class ParamUnit:
    index: int
    label: str
    entries: list[ParamEntry]
    numel: int
    master: torch.Tensor
    stream: torch.Tensor
    unique: list[ParamEntry] = field(default_factory=list)
    trainable_numel: int = -1  # elements [0, trainable_numel) train; -1: all of them

    def __post_init__(self) -> None:
        if self.trainable_numel < 0:
            self.trainable_numel = self.numel

    @property
    def trained(self) -> list[ParamEntry]:
        """The distinct parameters of the trainable prefix (``unique``'s first ones)."""
        return [e for e in self.unique if e.offset < self.trainable_numel]


def collect_entries(modules: list[nn.Module], itemsize: int) -> tuple[list[ParamEntry], list[ParamEntry], int]:
    """The flat layout of one unit in a buffer of ``itemsize``-byte elements: every (module, name) slot, the
    distinct parameters (those that train first, then the frozen ones, then the 4-bit ones, each group in module
    order), the total size.

    A parameter reached twice (tied weights) gets one place in the flat buffer; both slots point at it.
    """
    slots: list[tuple[nn.Module, str, nn.Parameter]] = []
    owner: dict[int, tuple[nn.Module, str, nn.Parameter]] = {}  # each distinct parameter's first slot
    seen_modules: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for name, param in module._parameters.items():
                if param is not None:
                    slots.append((module, name, param))
                    owner.setdefault(id(param), (module, name, param))
    firsts = list(owner.values())
    packed = [s for s in firsts if is_packed_4bit(s[2])]
    plain = [s for s in firsts if not is_packed_4bit(s[2])]
    ordered = [s for s in plain if s[2].requires_grad] + [s for s in plain if not s[2].requires_grad] + packed
    placed: dict[int, ParamEntry] = {}
    unique: list[ParamEntry] = []
    total = 0
    for uid, (module, name, param) in enumerate(ordered):
        layout = Packed4bit.of(param) if is_packed_4bit(param) else None
        if layout is not None:
            total = aligned_numel(total, itemsize)
            if param.requires_grad:
                raise ValueError(f"{type(module).__name__}.{name} is a bitsandbytes 4-bit weight that requires grad:"
                                 " a 4-bit base cannot train; freeze it (peft's get_peft_model does) and train"
                                 " adapters over it")
        numel = param.numel() if layout is None else layout.numel(itemsize)
        entry = ParamEntry(module, name, param, total, numel, param.shape, uid, layout)
        placed[id(param)], total = entry, total + numel
        unique.append(entry)
    entries = [ParamEntry(m, n, p, placed[id(p)].offset, placed[id(p)].numel, placed[id(p)].shape, placed[id(p)].uid,
                          placed[id(p)].packed) for m, n, p in slots]
    return entries, unique, aligned_numel(total, itemsize) if packed else total


def trainable_numel(unique: list[ParamEntry]) -> int:
    """Elements of the unit's trainable prefix."""
    return sum(e.numel for e in unique if e.param.requires_grad)
