"""The host path's gradient sums: one fp32 accumulator per unit, exposed to the optimizer as ``.grad`` views.

Lightning's ``zero_grad`` sets ``.grad`` to None; the first gradient of a parameter after it then overwrites its
part of the accumulator instead of adding to it, which saves a zeroing pass over 4 bytes per parameter. A
parameter that no backward since then gave a gradient (frozen, or not reached) keeps ``.grad`` None, as in a plain
run: torch's optimizers skip such a parameter (no weight decay, no state, no step count) where a zero ``.grad``
would decay it and advance its moments. Under ``bf16-true`` the sum stays fp32 and a master-dtype copy is what
``.grad`` views.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lightning_lazytrain.engine.weights.layout import ParamUnit


@dataclass
class _Sum:
    grad: torch.Tensor | None = None  # fp32, the unit's flat layout
    param_grad: torch.Tensor | None = None  # the master-dtype copy ``.grad`` views, when masters are not fp32
    fresh: list[bool] = field(default_factory=list)  # per entry: this backward writes instead of adding


class HostAccumulators:
    def __init__(self, units: list[ParamUnit], master_dtype: torch.dtype) -> None:
        self.master_dtype = master_dtype
        self._sums = {unit.index: _Sum() for unit in units}

    def begin(self, unit: ParamUnit) -> None:
        """Called before a unit's gradients of one backward arrive: per entry, overwrite (``.grad`` is None) or
        accumulate."""
        s = self._sums[unit.index]
        if s.grad is None:
            s.grad = torch.empty(unit.trainable_numel, dtype=torch.float32)  # frozen parameters get none
            if self.master_dtype != torch.float32:
                s.param_grad = torch.empty(unit.trainable_numel, dtype=self.master_dtype)
        s.fresh = [e.param.grad is None for e in unit.unique]

    def add(self, unit: ParamUnit, entry: int, offset: int, values: torch.Tensor) -> None:
        """Add (or write, for the entry's first gradient after zero_grad) one gradient segment of
        ``unit.unique[entry]`` at ``offset`` of the flat layout; runs on a worker thread."""
        s = self._sums[unit.index]
        target = s.grad[offset : offset + values.numel()]
        if s.fresh[entry]:
            target.copy_(values)
        else:
            target.add_(values)

    def finish(self, unit: ParamUnit, covered: set[int]) -> None:
        """After all segments of a backward landed: expose ``.grad`` views of the entries (indices into
        ``unit.unique``) that have a gradient, from this backward (``covered``) or an earlier one."""
        s = self._sums[unit.index]
        grad = s.grad
        if s.param_grad is not None:
            s.param_grad.copy_(grad)
            grad = s.param_grad
        for i, (entry, fresh) in enumerate(zip(unit.unique, s.fresh)):
            if fresh and i not in covered:
                continue
            view = grad[entry.offset : entry.offset + entry.numel].view(entry.shape)
            if entry.param.grad is None or entry.param.grad.data_ptr() != view.data_ptr():
                entry.param.grad = view
        s.fresh = []

    def held_bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for s in self._sums.values() for t in (s.grad, s.param_grad) if t is not None
        )
