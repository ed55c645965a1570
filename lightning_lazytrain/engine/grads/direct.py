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
from lightning_lazytrain.engine.weights.store import HostParamStore, ParamUnit
from lightning_lazytrain.optim import grad_norm_sq


class DirectGradSink:
    def __init__(self, store: HostParamStore, queues: DeviceQueues, dtype: torch.dtype) -> None:
        self.store = store
        self.queues = queues
        self.d2h_bytes = 0
        for unit in store.units:
            unit.grad_lowp = None if unit.update_on_device else store.pinned.empty(unit.numel, dtype)
        self._norm_sq: torch.Tensor | None = None

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None:
        unit.await_update()
        norm_sq = grad_norm_sq(grads).to(self.queues.device)
        self._norm_sq = norm_sq if self._norm_sq is None else self._norm_sq + norm_sq
        ready = self.queues.record()
        if unit.update_on_device:  # updated on the GPU: the gradients stay where they are
            unit.device_grads = list(grads)
            unit.grads_ready = ready
            unit.has_grads = True
            return
        self.queues.wait(ready, self.queues.d2h)
        with self.queues.on(self.queues.d2h):
            for entry, grad in zip(unit.unique, grads):
                target = unit.grad_lowp[entry.offset : entry.offset + entry.numel]
                if grad is None:
                    target.zero_()
                else:
                    target.copy_(grad.reshape(-1), non_blocking=True)
                    self.d2h_bytes += grad.numel() * grad.element_size()
        unit.grads_ready = self.queues.record(self.queues.d2h)
        unit.grad_refs = [g for g in grads if g is not None] if self.queues.is_cuda else None
        unit.has_grads = True

    def take_norm_sq(self) -> float:
        """The squared norm of every gradient since the last call (one host sync, at the optimizer step)."""
        total, self._norm_sq = self._norm_sq, None
        return float(total) if total is not None else 0.0

    def flush(self) -> None:
        """Nothing to wait for here: each update waits for its own unit's copy."""

    def forget(self) -> None:
        """A skipped step: no unit has gradients to update from."""
        for unit in self.store.units:
            unit.has_grads = False

    def discard(self) -> None:
        """Forget a failed step's gradients and norm; the device tensors they came from may be freed."""
        self.take_norm_sq()
        self.forget()
        for unit in self.store.units:
            unit.device_grads = unit.grad_refs = None

    def close(self) -> None:
        for unit in self.store.units:
            unit.grad_lowp = unit.grad_refs = unit.device_grads = None
