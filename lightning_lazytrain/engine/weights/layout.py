"""The flat layout of a unit: which parameters it holds and where each sits in its flat buffers.

A *unit* is what moves as one piece: one decoder layer, or the resident set (embedding, final norm, head). A
``ParamUnit`` describes only that layout and its two host buffers; which version of the weights they hold and
whether an update is still writing them is ``versions.WeightVersions``'s, and the per-unit gradient state belongs
to the run's sink (``engine/grads/``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class ParamEntry:
    module: nn.Module
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    uid: int


@dataclass
class ParamUnit:
    index: int
    label: str
    entries: list[ParamEntry]
    numel: int
    master: torch.Tensor
    stream: torch.Tensor
    unique: list[ParamEntry] = field(default_factory=list)


def collect_entries(modules: list[nn.Module]) -> tuple[list[ParamEntry], list[ParamEntry], int]:
    """The flat layout of one unit: every (module, name) slot, the distinct parameters in order, the total size.

    A parameter reached twice (tied weights) gets one place in the flat buffer; both slots point at it.
    """
    entries: list[ParamEntry] = []
    offsets: dict[int, int] = {}
    unique: list[ParamEntry] = []
    total = 0
    seen_modules: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for name, param in module._parameters.items():
                if param is None:
                    continue
                if id(param) not in offsets:
                    offsets[id(param)] = len(unique)
                    unique.append(ParamEntry(module, name, param, total, param.numel(), param.shape, len(unique)))
                    total += param.numel()
                first = unique[offsets[id(param)]]
                entries.append(ParamEntry(module, name, param, first.offset, first.numel, first.shape, first.uid))
    return entries, unique, total

