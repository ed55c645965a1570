"""Which units' optimizer updates run on the GPU beside the CPU's, so the update that follows a backward ends sooner.

With gradient clipping no update may start before the whole backward has given the norm, and the next forward
needs layer ``i`` updated before it runs: the CPU update is exposed wherever it is longer than the next forward.
The GPU is nearly idle then and the link has room, so a share of the units is updated there
(``updates/device.py``): it moves ``master + states`` bytes in and ``master + states + stream copy`` bytes out per
parameter, pipelined so that both directions of the link stay busy; the GPU arithmetic is negligible beside that.

Which units: in the order the next forward needs them, each unit goes to the path (CPU worker or device worker)
that would finish it first, from the CPU update rate (timed on a scratch tensor at setup) and the link rates. The
next forward's weight copies share the H2D link; that is not modelled, so the split leans slightly towards the
device.

``share="plan"``: the split of the update-placement MILP (``schedule/milp_updates.py``), which also counts that
the next forward reaches unit u only after units 0..u-1 have run, so late units may finish later. Each unit's
forward is taken as its weight copy (stream bytes / H2D rate): a lower estimate, known before any batch is seen.
Off CUDA the link is the H200's published figures (a test of the control flow, as a fixed share is there).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import torch

from lightning_lazytrain.engine.updates.device import IN_FLIGHT, staging_bytes
from lightning_lazytrain.engine.weights.layout import ParamUnit

log = logging.getLogger(__name__)


# device bytes per element of the largest parameter that the torch update's temporaries take at their peak
# (fp32 gradient, decoded moments, new moments, denominator, new weights, int64 code indices)
UPDATE_WORK_BYTES_PER_ELEMENT = 48


@dataclass
class UnitTraffic:
    numel: int
    h2d_bytes: int
    d2h_bytes: int
    grad_bytes: int
    largest: int = 0  # elements of the unit's largest parameter


def unit_traffic(unit: ParamUnit, optimizer: torch.optim.Optimizer, stream_itemsize: int) -> UnitTraffic:
    """Bytes the device path moves for ``unit`` and the device bytes its kept gradients hold."""
    h2d = d2h = numel = largest = 0
    for e in unit.unique:
        states = sum(t.numel() * t.element_size() for t in optimizer.state_tensors(e.param))
        master = e.numel * e.param.element_size()
        copy = e.numel * 2 if e.param.dtype != torch.bfloat16 else 0
        h2d += master + states
        d2h += master + states + copy
        numel += e.numel
        largest = max(largest, e.numel)
    return UnitTraffic(numel, h2d, d2h, numel * stream_itemsize, largest)


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
    fake = [UnitTraffic(t.numel, t.numel, t.numel, t.grad_bytes) for t in traffic]
    return split_units(fake, 1.0 - share, share, share)


def measure_cpu_update_rate(optimizer: torch.optim.Optimizer, numel: int = 1 << 25) -> float:
    """Parameters per second of ``optimizer``'s CPU update on a scratch tensor, in the engine's configuration
    (bf16 gradient, clip coefficient, bf16 stream copy), with its 8-bit setting for large tensors."""
    from lightning_lazytrain.optim import HybridAdamW

    eight_bit = any(optimizer.is_8bit(p) for g in optimizer.param_groups for p in g["params"])
    param = torch.zeros(numel)
    scratch = HybridAdamW([param], lr=1e-6, eight_bit_fraction=1.0 if eight_bit else 0.0,
                          num_threads=getattr(optimizer, "num_threads", None))
    scratch.register_stream_copy(param, torch.empty(numel, dtype=torch.bfloat16))
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    scratch.step_params([param], 0.5, [grad])
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        scratch.step_params([param], 0.5, [grad])
        best = min(best, time.perf_counter() - start)
    return numel / best


def update_problem(traffic: list[UnitTraffic], cpu_params_per_s: float, h2d_bytes_per_s: float,
                   d2h_bytes_per_s: float):
    """The MILP's inputs for ``traffic`` (forward order): CPU seconds from the update rate, device seconds from the
    link (as ``split_units``), each unit's next forward as its weight copy (``grad_bytes``: stream-dtype bytes)."""
    from lightning_lazytrain.schedule.milp_updates import UpdateProblem

    return UpdateProblem(
        cpu_seconds=[t.numel / cpu_params_per_s for t in traffic],
        device_seconds=[max(t.h2d_bytes / h2d_bytes_per_s, t.d2h_bytes / d2h_bytes_per_s) for t in traffic],
        forward_seconds=[t.grad_bytes / h2d_bytes_per_s for t in traffic],
    )


def check_share(share: float | str | None) -> float | Literal["plan"] | None:
    """``share`` if it is a ``device_update_share`` value, else a ValueError naming the ones there are."""
    if not (share is None or share == "plan" or (isinstance(share, (int, float)) and 0.0 <= share <= 1.0)):
        raise ValueError(f"device_update_share must be in [0, 1], 'plan' (the MILP's split) or None (automatic), "
                         f"got {share!r}")
    return share


def assign_device_updates(units: list[ParamUnit], optimizer: torch.optim.Optimizer,
                          share: float | Literal["plan"] | None, device: torch.device,
                          stream_itemsize: int) -> tuple[list[bool], int]:
    """Which units' update runs on ``device`` (``share`` of the parameters; ``"plan"``: the MILP's split; ``None``:
    the timing split on CUDA, none elsewhere), and the device bytes that holds beside the plan's activations."""
    traffic = [unit_traffic(u, optimizer, stream_itemsize) for u in units]
    if share == "plan":
        flags = _planned_split(optimizer, traffic, device)
    elif share is not None:
        flags = split_by_share(traffic, share)
    elif device.type == "cuda":
        flags = _timed_split(optimizer, traffic, device)
    else:
        flags = [False] * len(units)
    on_device = [t for t, f in zip(traffic, flags, strict=True) if f]
    # kept gradients until their update ran, the staging buffers DeviceUpdatePath allocates (one per unit in
    # flight) and the update's temporaries for the largest parameter
    staging = IN_FLIGHT * max((staging_bytes(u, optimizer) for u, f in zip(units, flags) if f), default=0)
    work = UPDATE_WORK_BYTES_PER_ELEMENT * max((t.largest for t in on_device), default=0)
    return flags, sum(t.grad_bytes for t in on_device) + staging + work


def _link(device: torch.device) -> tuple[float, float]:
    """(H2D, D2H) bytes/s with both directions busy: measured on CUDA, the H200's figures elsewhere."""
    if device.type == "cuda":
        from lightning_lazytrain.engine.link import measure_link_cuda

        h2d, d2h, duplex = measure_link_cuda(device)
    else:
        from lightning_lazytrain.schedule.profile import H200_D2H, H200_DUPLEX, H200_H2D

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
    from lightning_lazytrain.schedule.milp_updates import solve_updates

    cpu_rate = measure_cpu_update_rate(optimizer)
    h2d, d2h = _link(device)
    split = solve_updates(update_problem(traffic, cpu_rate, h2d, d2h))
    _log_split(f"MILP split ({split.status}, forward wait {split.wait_seconds:.3f} s)", traffic, split.on_device,
               cpu_rate, h2d, d2h)
    return split.on_device
