"""The gradient/update path of a run, chosen once at setup: where weight gradients go and who runs the update.

- ``host_path``: fp32 host accumulators exposed as ``.grad``; the user's optimizer steps, as Lightning calls it.
- ``direct_path``: bf16 gradients into per-unit pinned buffers, ``HybridAdamW.step_params`` per unit on a worker
  thread (a share of the units possibly on the GPU, ``updates/device.py``).
- ``sharded_path``: several processes; gradients reduce-scattered on the device, each rank updates its shard.

The executor is given one path and keeps it for the run; nothing is built to be closed and replaced.
"""

from __future__ import annotations

import logging
from typing import Any

import psutil
import torch

from lightning_lazytrain.engine.device import DeviceQueues, device_free_bytes
from lightning_lazytrain.engine.grads.direct import DirectGradSink
from lightning_lazytrain.engine.grads.homes import HOST_HEADROOM_SHARE, choose_gradient_home
from lightning_lazytrain.engine.grads.host import GradSink
from lightning_lazytrain.engine.grads.sharded import ShardedGradSink
from lightning_lazytrain.engine.updates.cpu import UpdateQueue
from lightning_lazytrain.engine.updates.device import DeviceUpdateQueue
from lightning_lazytrain.engine.updates.sharded import ShardedUpdateQueue
from lightning_lazytrain.engine.updates.traffic import DevicePlacement
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.optim import NonFiniteGuard, clip_coefficient, managed_ids

log = logging.getLogger(__name__)


class UpdatePath:
    """One run's gradient sink and, when the engine runs the update itself, its update queue."""

    def __init__(self, sink: GradSink | DirectGradSink | ShardedGradSink,
                 updates: UpdateQueue | ShardedUpdateQueue | None = None, device_reserve_bytes: int = 0) -> None:
        self.sink, self.updates = sink, updates
        self.gradient_home = getattr(sink, "home", "host")  # where the gradients wait for the norm (grads/homes.py)
        self.device_reserve_bytes = device_reserve_bytes  # device memory the plan must leave the device-side updates

    @property
    def device_held_bytes(self) -> int:
        """Device memory the device-side updates took at setup (homes or staging buffers)."""
        device_queue = getattr(self.updates, "device_queue", None)
        return device_queue.held_bytes if device_queue is not None else 0

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose states the engine's updates allocate (None: Lightning steps the user's)."""
        return self.updates.optimizer if self.updates is not None else None

    def step(self, clip_val: float | None, guard: NonFiniteGuard, step: int) -> bool:
        """Queue this step's updates (clipped by the device-side norm); False when a non-finite norm skips it."""
        assert self.updates is not None and isinstance(self.sink, (DirectGradSink, ShardedGradSink))
        norm_sq = self.sink.take_norm_sq()
        if not guard.check(norm_sq, step):
            self.sink.forget()
            return False
        coef = clip_coefficient(norm_sq, clip_val) if clip_val else 1.0
        self.updates.enqueue(coef)
        return True

    def wait(self) -> None:
        if self.updates is not None:
            self.updates.wait_all()

    def host_state_changed(self) -> None:
        """A checkpoint load rewrote the host masters or replaced the optimizer states."""
        if self.updates is not None:
            self.updates.host_state_changed()

    def discard(self) -> None:
        """Forget the gradients of a step that failed half-way (landed or in flight)."""
        self.sink.discard()

    def optimizer_state(self) -> dict[str, Any] | None:
        """What a checkpoint saves as the optimizer state when it is not the user's optimizer's own."""
        return None

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        """Restore ``optimizer_state()``'s dict; False when the user's optimizer loads its own."""
        return False

    def close(self) -> None:
        if self.updates is not None:
            self.updates.close()
        self.sink.close()


class ShardedUpdatePath(UpdatePath):
    """The optimizer state is the shard optimizer's, and it is saved and loaded as such."""

    updates: ShardedUpdateQueue

    def optimizer_state(self) -> dict[str, Any] | None:
        return self.updates.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        self.updates.load_state_dict(state)
        return True


def host_path(store: HostParamStore, queues: DeviceQueues, staging_numel: int, timeout_s: float) -> UpdatePath:
    """Gradients accumulated in fp32 on the host as ``.grad``, for any torch optimizer."""
    return UpdatePath(GradSink(store, queues, staging_numel, store.stream_dtype, timeout_s=timeout_s))


def direct_path(store: HostParamStore, queues: DeviceQueues, optimizer: torch.optim.Optimizer,
                placement: DevicePlacement, timeout_s: float, gradient_home: str = "host",
                spill_dir: str | None = None) -> UpdatePath:
    """The engine runs ``optimizer.step_params`` per unit from bf16 gradients, off the main thread.

    ``placement``: which units' update runs on the GPU beside the CPU's, as the plan side chose it
    (`lightning_lazytrain.planning.update_placement`), and whether their masters and states stay on the device
    between steps. ``gradient_home``: where the other units' gradients wait for the norm (``grads/homes.py``;
    ``"plan"``: the one that fits this host).
    """
    units = store.units
    on_device, reserve, resident = placement.on_device, placement.reserve_bytes, placement.resident
    if gradient_home == "plan":
        gradient_home = planned_gradient_home(store, queues.device, on_device, spill_dir)
    sink = DirectGradSink(store, queues, store.stream_dtype, on_device, gradient_home, spill_dir, timeout_s)
    reserve += sink.device_bytes()  # the device home's gradients wait there beside the plan's activations
    if store.master_dtype != store.stream_dtype:
        managed = managed_ids(optimizer)
        for unit in units:
            for e in unit.trained:
                if id(e.param) in managed:
                    optimizer.register_stream_copy(e.param, unit.stream[e.offset : e.offset + e.numel].view(e.shape))
    device_units = [u for u, flag in zip(units, on_device, strict=True) if flag]
    device_queue = DeviceUpdateQueue(optimizer, device_units, queues, timeout_s, resident) if device_units else None
    return UpdatePath(sink, UpdateQueue(optimizer, store.versions, sink, timeout_s, device_queue), reserve)


def planned_gradient_home(store: HostParamStore, device: torch.device, on_device: list[bool],
                          spill_dir: str | None) -> str:
    """``gradient_home="plan"`` at setup: the host when its available RAM, less ``HOST_HEADROOM_SHARE`` of it for
    what the run holds besides (CPU activation homes, the data loader), holds the gradients of the CPU-updated
    units, else the device, else NVMe (``choose_gradient_home``). The masters, streamed copy and ``HybridAdamW``'s
    states exist by now, so the available RAM is what is left after them."""
    grad_bytes = sum(u.trainable_numel * store.stream_dtype.itemsize
                     for u, flag in zip(store.units, on_device, strict=True) if not flag)
    host_left = int(psutil.virtual_memory().available * (1 - HOST_HEADROOM_SHARE))
    free = device_free_bytes(device) if device.type == "cuda" else None
    home = choose_gradient_home(grad_bytes, host_left, free, spill_dir)
    log.info("lazytrain: gradient home %s (%.2f GiB of gradients; host RAM left %.2f GiB%s)", home, grad_bytes / 2**30,
             host_left / 2**30, "" if free is None else f", device free {free / 2**30:.2f} GiB")
    return home


def sharded_path(store: SharedParamStore, queues: DeviceQueues, optimizer: torch.optim.Optimizer,
                 timeout_s: float) -> ShardedUpdatePath:
    """Several processes: gradients are reduce-scattered on the device, each rank updates its own shard of every
    unit with a shard optimizer built from ``optimizer``."""
    sink = ShardedGradSink(store, queues, store.stream_dtype)
    return ShardedUpdatePath(sink, ShardedUpdateQueue(optimizer, store, sink, timeout_s))
