"""What the device path of the optimizer update costs per unit, and the placement it is handed.

Where each unit's update runs is decided on the plan side (`lightning_lazytrain.planning.update_placement`) from
these figures; the engine receives the result, a `DevicePlacement`, and builds its queues from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.updates.device import staging_bytes
from lightning_lazytrain.engine.updates.device_kernel import update_work_bytes
from lightning_lazytrain.engine.weights.layout import ParamUnit


@dataclass(frozen=True)
class DevicePlacement:
    """Per unit, whether its update runs on the device; the device bytes that holds beside the plan's activations
    (the kept gradients until their update ran and the largest update's temporaries); whether the device units'
    masters and states stay on the device between steps."""

    on_device: list[bool]
    reserve_bytes: int = 0
    resident: bool = False


@dataclass
class UnitTraffic:
    numel: int
    h2d_bytes: int
    d2h_bytes: int
    grad_bytes: int
    stream_bytes: int  # its whole streamed copy (frozen and 4-bit weights too): what its next forward copies in
    work_bytes: int = 0  # device bytes at the peak of its largest parameter's update (``update_work_bytes``)
    home_bytes: int = 0  # device bytes its masters and states take when they stay there (``staging_bytes``)


def unit_traffic(
    unit: ParamUnit, optimizer: torch.optim.Optimizer, stream_itemsize: int, resident: bool, device: torch.device
) -> UnitTraffic:
    """Bytes the device path moves for ``unit`` before the next forward may stream it (``resident``: only the
    stream copy out), the device bytes its kept gradients hold, and its update's peak on ``device``."""
    h2d = d2h = numel = work = 0
    for e in unit.trained:  # a frozen parameter has no update to move
        states = sum(t.numel() * t.element_size() for t in optimizer.state_tensors(e.param))
        master = e.numel * e.param.element_size()
        copy = e.numel * 2 if e.param.dtype != torch.bfloat16 else 0
        h2d += 0 if resident else master + states
        d2h += (copy or master) if resident else master + states + copy
        numel += e.numel
        work = max(work, update_work_bytes(e.param, optimizer.state.get(e.param, {}), device))
    return UnitTraffic(numel, h2d, d2h, numel * stream_itemsize, unit.numel * stream_itemsize, work,
                       staging_bytes(unit, optimizer))
