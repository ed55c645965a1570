"""Which units' optimizer updates run on the GPU beside the CPU's, so the update that follows a backward ends sooner.

The decision is the plan side's: the engine gets its result (`engine.updates.traffic.DevicePlacement`) through
`engine.updates.paths.direct_path`, and imports nothing from here.

With gradient clipping no update may start before the whole backward has given the norm, and the next forward
needs layer ``i`` updated before it runs: the CPU update is exposed wherever it is longer than the next forward.
The GPU is nearly idle then and the link has room, so a share of the units is updated there
(`engine/updates/device.py`): it moves ``master + states`` bytes in and ``master + states + stream copy`` bytes out per
parameter, pipelined so that both directions of the link stay busy; the GPU arithmetic is negligible beside that.

Which units: in the order the next forward needs them, each unit goes to the path (CPU worker or device worker)
that would finish it first, from the CPU update rate (timed on a scratch tensor at setup) and the link rates. The
next forward's weight copies share the H2D link; that is not modelled, so the split leans slightly towards the
device.

``share="plan"``: the split of the update-placement MILP (``schedule/milp_updates.py``), which also counts that
the next forward reaches unit u only after units 0..u-1 have run, so late units may finish later. Each unit's
forward is taken as its weight copy (stream bytes / H2D rate): a lower estimate, known before any batch is seen.
It is the strategy's default, so off CUDA (``PLANNED_DEVICE_TYPES``) it places nothing: there is no GPU beside the
CPU there, and every run on the CPU accelerator would otherwise time a scratch update at setup and send units
through the torch reference on copies. A fixed share still runs there (a test of the control flow).

``states="resident"`` keeps a device unit's masters and states on the GPU between steps (`engine/updates/device.py`):
its update then moves only the stream copy out (masters and states are written back when the queue is drained),
so the split above sees a much cheaper device. ``"auto"`` does so on CUDA for as many of the chosen units, in
forward order, as fit in ``RESIDENT_SHARE_OF_FREE`` of the free device memory (the rest go back to the CPU worker),
and never elsewhere; ``"staged"`` never.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.engine.link import measure_link_cuda
from lightning_lazytrain.engine.updates.traffic import DevicePlacement, UnitTraffic, unit_traffic
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.optim.update_rate import time_update
from lightning_lazytrain.schedule.milp_updates import UpdateProblem, solve_updates
from lightning_lazytrain.schedule.profile import H200_D2H, H200_DUPLEX, H200_H2D

log = logging.getLogger(__name__)
PLANNED_DEVICE_TYPES = ("cuda",)  # where share="plan" asks the MILP; elsewhere every update stays on the CPU


RESIDENT_SHARE_OF_FREE = 0.4  # of the device memory free at setup, what resident masters and states may take

DeviceStates = Literal["auto", "resident", "staged"]
DEVICE_STATES = ("auto", "resident", "staged")


@dataclass(frozen=True)
class DeviceUpdates:
    """Device-side updates as the strategy chose them: ``share`` (``check_device_updates``) and where states live."""

    share: float | Literal["plan"] | None = 0.0
    states: DeviceStates = "auto"


def split_units(traffic: list[UnitTraffic], cpu_params_per_s: float, h2d_bytes_per_s: float,
                d2h_bytes_per_s: float) -> list[bool]:
    """For units in the order the next forward needs them: True where the device worker would finish it first."""
    t_cpu = t_dev = 0.0
    out = []
    for t in traffic:
        cpu = t.numel / cpu_params_per_s
        dev = max(t.h2d_bytes / h2d_bytes_per_s, t.d2h_bytes / d2h_bytes_per_s)
        on_device = t_dev + dev < t_cpu + cpu
        if on_device:
            t_dev += dev
        else:
            t_cpu += cpu
        out.append(on_device)
    return out


def split_by_share(traffic: list[UnitTraffic], share: float) -> list[bool]:
    """A fixed share of the parameters on the device path, spread over the forward order as the timing split is."""
    if share <= 0:
        return [False] * len(traffic)
    if share >= 1:
        return [True] * len(traffic)
    fake = [UnitTraffic(t.numel, t.numel, t.numel, t.grad_bytes, t.stream_bytes) for t in traffic]
    return split_units(fake, 1.0 - share, share, share)


def measure_cpu_update_rate(optimizer: torch.optim.Optimizer, numel: int = 1 << 25) -> float:
    """Parameters per second of ``optimizer``'s CPU update on a scratch tensor, in the engine's configuration
    (bf16 gradient, clip coefficient, bf16 stream copy), with its 8-bit setting for large tensors."""
    eight_bit = any(optimizer.is_8bit(p) for g in optimizer.param_groups for p in g["params"])
    return time_update(eight_bit, getattr(optimizer, "num_threads", None), numel)


def update_problem(traffic: list[UnitTraffic], cpu_params_per_s: float, h2d_bytes_per_s: float,
                   d2h_bytes_per_s: float) -> UpdateProblem:
    """The MILP's inputs for ``traffic`` (forward order): CPU seconds from the update rate, device seconds from the
    link (as ``split_units``), each unit's next forward as its weight copy (``stream_bytes``: the whole streamed
    unit, a frozen base's included)."""
    return UpdateProblem(
        cpu_seconds=[t.numel / cpu_params_per_s for t in traffic],
        device_seconds=[max(t.h2d_bytes / h2d_bytes_per_s, t.d2h_bytes / d2h_bytes_per_s) for t in traffic],
        forward_seconds=[t.stream_bytes / h2d_bytes_per_s for t in traffic],
    )


def check_device_updates(share: float | str | None, states: str = "auto") -> DeviceUpdates:
    """The strategy's ``device_update_share`` / ``device_update_states``, or a ValueError naming the values there
    are."""
    if not (share is None or share == "plan" or (isinstance(share, (int, float)) and 0.0 <= share <= 1.0)):
        raise ValueError(f"device_update_share must be in [0, 1], 'plan' (the MILP's split) or None (automatic), "
                         f"got {share!r}")
    if states not in DEVICE_STATES:
        raise ValueError(f"device_update_states must be one of {DEVICE_STATES}, got {states!r}")
    return DeviceUpdates(share, states)  # type: ignore[arg-type]


def place_updates(units: list[ParamUnit], optimizer: torch.optim.Optimizer, choice: DeviceUpdates,
                  device: torch.device, stream_itemsize: int) -> DevicePlacement:
    """Which units' update runs on ``device`` (``choice.share`` of the parameters; ``"plan"``: the MILP's split on
    CUDA, none elsewhere; ``None``: the timing split on CUDA, none elsewhere), the device bytes that holds beside the
    plan's activations, and whether their masters and states stay on the device (module docstring)."""
    share = choice.share
    resident = choice.states == "resident" or (choice.states == "auto" and device.type == "cuda")
    traffic = [unit_traffic(u, optimizer, stream_itemsize, resident, device) for u in units]
    if share == "plan":
        planned = device.type in PLANNED_DEVICE_TYPES
        flags = _planned_split(optimizer, traffic, device) if planned else [False] * len(units)
    elif share is not None:
        flags = split_by_share(traffic, share)
    elif device.type == "cuda":
        flags = _timed_split(optimizer, traffic, device)
    else:
        flags = [False] * len(units)
    if resident and choice.states == "auto":
        flags = homes_that_fit(traffic, flags, RESIDENT_SHARE_OF_FREE * device_free_bytes(device))
    on_device = [t for t, f in zip(traffic, flags, strict=True) if f]
    # what a plan must leave free: the kept gradients until their update ran and the largest update's temporaries
    # (one update runs at a time). The homes or staging buffers are allocated with the path, before any plan reads
    # the free memory, so counting them here would count them twice.
    work = max((t.work_bytes for t in on_device), default=0)
    return DevicePlacement(flags, sum(t.grad_bytes for t in on_device) + work, resident)


def homes_that_fit(traffic: list[UnitTraffic], flags: list[bool], budget: float) -> list[bool]:
    """``flags`` with the device units, in forward order, whose resident homes no longer fit ``budget`` (device
    bytes) handed back to the CPU worker."""
    out, used = [], 0
    for t, flag in zip(traffic, flags, strict=True):
        fits = flag and used + t.home_bytes <= budget
        used += t.home_bytes if fits else 0
        out.append(fits)
    if sum(out) < sum(flags):
        log.info("lazytrain: %d of %d device-updated units keep their states on the device (%.1f GiB); the rest"
                 " update on the CPU", sum(out), sum(flags), used / 2**30)
    return out


def _link(device: torch.device) -> tuple[float, float]:
    """(H2D, D2H) bytes/s with both directions busy: measured on CUDA, the H200's figures elsewhere."""
    if device.type == "cuda":
        h2d, d2h, duplex = measure_link_cuda(device)
    else:
        h2d, d2h, duplex = H200_H2D, H200_D2H, H200_DUPLEX
    return min(h2d, duplex / 2), min(d2h, duplex / 2)  # both directions run at once


def _log_split(how: str, traffic: list[UnitTraffic], flags: list[bool], cpu_rate: float, h2d: float,
               d2h: float) -> None:
    share = sum(t.numel for t, f in zip(traffic, flags, strict=True) if f) / max(1, sum(t.numel for t in traffic))
    log.info("lazytrain: CPU update %.2f G params/s, link %.1f / %.1f GB/s -> %s: %.0f%% of the parameters updated"
             " on the GPU", cpu_rate / 1e9, h2d / 1e9, d2h / 1e9, how, 100 * share)


def _timed_split(optimizer: torch.optim.Optimizer, traffic: list[UnitTraffic], device: torch.device) -> list[bool]:
    cpu_rate = measure_cpu_update_rate(optimizer)
    h2d, d2h = _link(device)
    flags = split_units(traffic, cpu_rate, h2d, d2h)
    _log_split("greedy split", traffic, flags, cpu_rate, h2d, d2h)
    return flags


def _planned_split(optimizer: torch.optim.Optimizer, traffic: list[UnitTraffic], device: torch.device) -> list[bool]:
    cpu_rate = measure_cpu_update_rate(optimizer)
    h2d, d2h = _link(device)
    split = solve_updates(update_problem(traffic, cpu_rate, h2d, d2h))
    _log_split(f"MILP split ({split.status}, forward wait {split.wait_seconds:.3f} s)", traffic, split.on_device,
               cpu_rate, h2d, d2h)
    return split.on_device
