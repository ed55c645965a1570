"""Gradients for an optimizer that updates from them in place, each unit's waiting in its gradient home.

When the engine runs the update itself (``HybridAdamW.step_params``), there is no fp32 ``.grad`` to fill. Where each
unit's gradients wait for the global norm is the run's gradient home (``homes.py``): ``"host"``, a per-unit pinned
buffer in the compute dtype (2 bytes per parameter under bf16, pinned once at setup) filled on the D2H stream, from
which the update job reads after waiting on the copy's event; ``"device"``, kept on the device and staged into a
pinned buffer just ahead of the update; ``"nvme"``, written to the spill dir through a staging buffer and read back
ahead of the update (``staging.py``). Nothing runs on the CPU during the backward. The squared gradient norm is
summed on the device as the layers go, for clipping and the non-finite check, whatever the home. Units updated on
the device (``engine/updates/device.py``) keep their gradients there.
"""

from __future__ import annotations

import torch

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.grads.handoff import HandoffSink, UnitGrads
from lightning_lazytrain.engine.grads.homes import STAGED_HOMES, pieces, staging_numel
from lightning_lazytrain.engine.grads.staging import GradStaging
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.optim import grad_norm_sq


class DirectGradSink(HandoffSink):
    def __init__(self, store: HostParamStore, queues: DeviceQueues, dtype: torch.dtype,
                 on_device: list[bool] | None = None, home: str = "host", spill_dir: str | None = None,
                 timeout_s: float = 600.0) -> None:
        super().__init__(store, queues)
        self.home = home
        flags = on_device or [False] * len(store.units)
        staged = home in STAGED_HOMES and not all(flags)
        self.staging = None
        if staged:
            numel = staging_numel(store.units)
            spilled = [u for u, flag in zip(store.units, flags, strict=True) if not flag] if home == "nvme" else None
            self.staging = GradStaging(queues, store.pinned, numel, dtype, timeout_s, spill_dir, spilled)
        for unit, flag in zip(store.units, flags, strict=True):
            grads = self.of(unit)
            grads.on_device = flag
            if not flag and staged:
                grads.pieces = pieces(unit, self.staging.capacity)
            elif not flag:
                grads.host = store.pinned.empty(unit.trainable_numel, dtype)  # none for frozen parameters

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        self.store.versions.wait(unit)  # its update reads the gradient buffer this overwrites
        self._add_norm(grad_norm_sq(grads).to(self.queues.device))
        handoff = self.of(unit)
        ready = self.queues.record()
        handoff.fresh = True
        if handoff.on_device or (handoff.pieces is not None and self.home == "device"):
            handoff.kept = list(grads)  # updated on the GPU, or staged for the CPU's update once the norm is known
            handoff.ready = ready
            return
        self.queues.wait(ready, self.queues.d2h)
        if handoff.pieces is not None:  # nvme
            handoff.written = [self.staging.spill_piece(unit, piece, grads) for piece in handoff.pieces]
            self.d2h_bytes += unit.trainable_numel * self.staging.dtype.itemsize
            return
        self._copy_to_host(handoff, unit, grads)

    def _copy_to_host(self, handoff: UnitGrads, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        with self.queues.on(self.queues.d2h):
            for entry, grad in zip(unit.trained, grads):
                target = handoff.host[entry.offset : entry.offset + entry.numel]
                if grad is None:
                    target.zero_()
                else:
                    target.copy_(grad.reshape(-1), non_blocking=True)
                    self.d2h_bytes += grad.numel() * grad.element_size()
        handoff.ready = self.queues.record(self.queues.d2h)
        if self.queues.is_cuda:
            # The copy still reads them: the allocator reuses their memory only once the D2H stream has passed it.
            # Holding them until the update ran instead kept every layer's gradients on the device through the
            # whole backward (2 bytes a parameter: 14 GiB at 7B), which no plan counts.
            for grad in grads:
                if grad is not None:
                    grad.record_stream(self.queues.d2h)

    def stage(self, unit: ParamUnit) -> None:
        """The norm is known and ``unit``'s update is queued: start staging its pieces for it, in order."""
        handoff = self.of(unit)
        kept, handoff.kept = handoff.kept, None
        written, handoff.written = handoff.written, None
        handoff.staged = [self.staging.fetch(unit, piece, kept, handoff.ready, written[k] if written else None)
                          for k, piece in enumerate(handoff.pieces)]
        if kept is not None:
            self.d2h_bytes += unit.trainable_numel * self.staging.dtype.itemsize

    def held_bytes(self) -> int:
        return super().held_bytes() + (self.staging.held_bytes if self.staging is not None else 0)

    def device_bytes(self) -> int:
        """Device bytes the device home keeps between a backward and the updates (units updated on the CPU)."""
        if self.home != "device":
            return 0
        return sum(u.trainable_numel * self.store.stream_dtype.itemsize for u in self.store.units
                   if self.of(u).pieces is not None)

    def take_norm_sq(self) -> float:
        """The squared norm of every gradient since the last call (one host sync, at the optimizer step)."""
        total = self._take_norm()
        return float(total) if total is not None else 0.0

    def discard(self) -> None:
        for grads in self.grads.values():
            for future in grads.written or []:
                future.exception(timeout=self.staging.timeout_s)  # a half-done write must not outlive its buffer
            grads.written = None
        super().discard()

    def close(self) -> None:
        super().close()
        if self.staging is not None:
            self.staging.close()
