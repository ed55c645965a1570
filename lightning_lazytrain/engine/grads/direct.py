"""Gradients straight into per-unit pinned host buffers, for an optimizer that updates from them in place.

When the engine runs the update itself (``HybridAdamW.step_params``), there is no fp32 ``.grad`` to fill: each
layer's gradients are copied on the D2H stream, in the compute dtype, into that unit's own buffer (2 bytes per
parameter under bf16, pinned once at setup), and the update job waits on the copy's event. Nothing runs on the
CPU during the backward. The squared gradient norm is summed on the device as the layers go, for clipping and the
non-finite check. Units updated on the device (``engine/updates/device.py``) keep their gradients there instead.
"""

from __future__ import annotations

import torch

from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.grads.handoff import HandoffSink
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.optim import grad_norm_sq


class DirectGradSink(HandoffSink):
    def __init__(self, store: HostParamStore, queues: DeviceQueues, dtype: torch.dtype,
                 on_device: list[bool] | None = None) -> None:
        super().__init__(store, queues)
        for unit, flag in zip(store.units, on_device or [False] * len(store.units), strict=True):
            grads = self.of(unit)
            grads.on_device = flag
            grads.host = None if flag else store.pinned.empty(unit.trainable_numel, dtype)  # none for frozen

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        self.store.versions.wait(unit)  # its update reads the gradient buffer this overwrites
        self._add_norm(grad_norm_sq(grads).to(self.queues.device))
        handoff = self.of(unit)
        ready = self.queues.record()
        if handoff.on_device:  # updated on the GPU: the gradients stay where they are
            handoff.kept = list(grads)
            handoff.ready = ready
            handoff.fresh = True
            return
        self.queues.wait(ready, self.queues.d2h)
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
        handoff.fresh = True

    def take_norm_sq(self) -> float:
        """The squared norm of every gradient since the last call (one host sync, at the optimizer step)."""
        total = self._take_norm()
        return float(total) if total is not None else 0.0
