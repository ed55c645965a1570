"""The flat layout of a unit: which parameters it holds and where each sits in its flat buffers.

A *unit* is what moves as one piece: one decoder layer, or the resident set (embedding, final norm, head). A
``ParamUnit`` describes only that layout and its two host buffers; which version of the weights they hold and
whether an update is still writing them is ``versions.WeightVersions``'s, and the per-unit gradient state belongs
to the run's sink (``engine/grads/``).

The parameters that train come first in the flat layout, the frozen ones after them (``trainable_numel`` marks
the border), so the masters, gradients and optimizer states of a unit cover one prefix of it and a frozen base
(LoRA) is held once, as its streamed copy. Which parameters train is read once, at setup.
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
    trainable_numel: int = -1  # elements [0, trainable_numel) train; -1: all of them

    def __post_init__(self) -> None:
        if self.trainable_numel < 0:
            self.trainable_numel = self.numel

    @property
    def trained(self) -> list[ParamEntry]:
        """The distinct parameters of the trainable prefix (``unique``'s first ones)."""
        return [e for e in self.unique if e.offset < self.trainable_numel]


def collect_entries(modules: list[nn.Module]) -> tuple[list[ParamEntry], list[ParamEntry], int]:
    """The flat layout of one unit: every (module, name) slot, the distinct parameters (those that train first,
    each group in module order), the total size.

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
    ordered = [s for s in firsts if s[2].requires_grad] + [s for s in firsts if not s[2].requires_grad]
    placed: dict[int, ParamEntry] = {}
    unique: list[ParamEntry] = []
    total = 0
    for uid, (module, name, param) in enumerate(ordered):
        entry = ParamEntry(module, name, param, total, param.numel(), param.shape, uid)
        placed[id(param)], total = entry, total + param.numel()
        unique.append(entry)
    entries = [ParamEntry(m, n, p, placed[id(p)].offset, placed[id(p)].numel, placed[id(p)].shape, placed[id(p)].uid)
               for m, n, p in slots]
    return entries, unique, total


def trainable_numel(unique: list[ParamEntry]) -> int:
    """Elements of the unit's trainable prefix."""
    return sum(e.numel for e in unique if e.param.requires_grad)
