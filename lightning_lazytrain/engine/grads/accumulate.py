"""The host path's gradient sums: one fp32 accumulator per unit, exposed to the optimizer as ``.grad`` views.

Lightning's ``zero_grad`` sets ``.grad`` to None; the first backward after it then overwrites the accumulator
instead of adding to it, which saves a zeroing pass over 4 bytes per parameter (what no gradient covered is zeroed
at the end). Under ``bf16-true`` the sum stays fp32 and a master-dtype copy is what ``.grad`` views.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.weights.layout import ParamUnit


@dataclass
class _Sum:
    grad: torch.Tensor | None = None  # fp32, the unit's flat layout
    param_grad: torch.Tensor | None = None  # the master-dtype copy ``.grad`` views, when masters are not fp32
    overwrite: bool = False  # this backward writes instead of adding (``.grad`` was None)


class HostAccumulators:
    def __init__(self, units: list[ParamUnit], master_dtype: torch.dtype) -> None:
        self.master_dtype = master_dtype
        self._sums = {unit.index: _Sum() for unit in units}

    def begin(self, unit: ParamUnit) -> None:
        """Called before a unit's gradients of one backward arrive: decide overwrite vs accumulate."""
        s = self._sums[unit.index]
        if s.grad is None:
            s.grad = torch.empty(unit.trainable_numel, dtype=torch.float32)  # frozen parameters get none
            if self.master_dtype != torch.float32:
                s.param_grad = torch.empty(unit.trainable_numel, dtype=self.master_dtype)
        s.overwrite = any(e.param.grad is None for e in unit.trained)

    def add(self, unit: ParamUnit, offset: int, values: torch.Tensor) -> None:
        """Add (or write, on the first backward after zero_grad) one gradient segment; runs on a worker thread."""
        s = self._sums[unit.index]
        target = s.grad[offset : offset + values.numel()]
        if s.overwrite:
            target.copy_(values)
        else:
            target.add_(values)

    def finish(self, unit: ParamUnit, covered: list[tuple[int, int]]) -> None:
        """After all segments of a backward landed: zero what got no gradient, expose ``.grad`` views."""
        s = self._sums[unit.index]
        if s.overwrite:
            for start, stop in _uncovered(unit.trainable_numel, covered):
                s.grad[start:stop].zero_()
        grad = s.grad
        if s.param_grad is not None:
            s.param_grad.copy_(grad)
            grad = s.param_grad
        for entry in unit.trained:
            view = grad[entry.offset : entry.offset + entry.numel].view(entry.shape)
            if entry.param.grad is None or entry.param.grad.data_ptr() != view.data_ptr():
                entry.param.grad = view
        s.overwrite = False

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._sums.values() for t in (s.grad, s.param_grad)
                   if t is not None)


def _uncovered(total: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    holes, cursor = [], 0
    for start, stop in sorted(covered):
        if start > cursor:
            holes.append((cursor, start))
        cursor = max(cursor, stop)
    if cursor < total:
        holes.append((cursor, total))
    return holes
