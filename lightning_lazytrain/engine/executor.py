"""The streaming executor: owns the host store, the weight slots, the activation homes and the run's update path.

It hooks the HF model (``compute/hooks.py``: names, parameters and ``state_dict`` unchanged), collects the recorded
layer calls, and runs them as one autograd Function over a frozen ``StackContext`` (``compute/stack.py``). The
embedding, norm and head run on a device-resident copy in the stream dtype whose gradients are drained to the host after
each backward. The gradient/update path (``updates/paths.py``) is given once, by ``use_path``, when the optimizer is
known.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from lightning_lazytrain.engine.activations.homes import ActivationHomes
from lightning_lazytrain.engine.compute.hooks import ModelHooks
from lightning_lazytrain.engine.compute.stack import LayerCall, StackContext, StackRun, StreamedStack
from lightning_lazytrain.engine.device import DeviceQueues, device_free_bytes
from lightning_lazytrain.engine.loss.chunked import LOSS_CHUNK_BYTES
from lightning_lazytrain.engine.plan import Schedule
from lightning_lazytrain.engine.updates.paths import UpdatePath
from lightning_lazytrain.engine.weights.binding import leaves_of
from lightning_lazytrain.engine.weights.slots import SlotPool
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.models import ModelAdapter
from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels, fused_count, unfuse_decoder_kernels
from lightning_lazytrain.optim import NonFiniteGuard


class DeviceTooSmallError(RuntimeError):
    """The weight slots and resident parts alone do not fit the device."""


class StreamingExecutor:
    def __init__(
        self,
        adapter: ModelAdapter,
        device: torch.device,
        master_dtype: torch.dtype,
        stream_dtype: torch.dtype,
        plan: Schedule,
        num_slots: int | None = None,
        prefetch_depth: int = 2,
        pin_memory: bool = True,
        timeout_s: float = 600.0,
        loss_chunk_bytes: int = LOSS_CHUNK_BYTES,
        spill_dir: str | None = None,
        store_factory: Callable[..., HostParamStore] = HostParamStore,
        fused_kernels: bool = False,
        loss_kernel: bool | None = None,
    ) -> None:
        if getattr(adapter.lm_head, "bias", None) is not None:
            raise ValueError("lazytrain's chunked loss supports a bias-free lm_head only (all supported families)")
        self.adapter, self.device = adapter, device
        self.prefetch_depth, self.loss_chunk_bytes = prefetch_depth, loss_chunk_bytes
        self.loss_kernel = loss_kernel  # the head loss's Triton kernel (``loss/kernel.py``); None: where it can run
        self.spill_dir, self.timeout_s = spill_dir, timeout_s
        self.queues = DeviceQueues(device)
        self.layers: list[nn.Module] = list(adapter.layers)
        if fused_kernels:
            fuse_decoder_kernels(self.layers)
        self.resident_modules = _resident_modules(adapter)
        groups = [("resident", self.resident_modules)] + [(f"layer.{j}", [m]) for j, m in enumerate(self.layers)]
        self.store = store_factory(groups, master_dtype, stream_dtype, pin=pin_memory and device.type == "cuda")
        self.resident_unit, self.layer_units = self.store.units[0], self.store.units[1:]
        self.slot_numel = max(u.numel for u in self.layer_units)
        self.pool: SlotPool | None = None
        self.homes: ActivationHomes | None = None
        self.set_plan(plan, num_slots)
        self.path: UpdatePath | None = None
        self._resident_buf = torch.empty(self.resident_unit.numel, dtype=self.store.stream_dtype, device=device)
        self._resident_leaves: list[torch.Tensor] | None = None
        self._resident_generation = -1
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._pending: list[LayerCall] = []
        self.batch_rows = 0  # the rows of the last batch the stack ran (the OOM ladder's micro-batch bound)
        self.hooks = ModelHooks(self, self.resident_modules)

    def use_path(self, path: UpdatePath) -> None:
        """Adopt the run's gradient/update path (``updates/paths.py``); it is chosen once and kept until close."""
        if self.path is not None:
            raise RuntimeError("the executor's update path is chosen once per run; close this executor first")
        self.path = path

    @property
    def sink(self) -> Any:
        if self.path is None:
            raise RuntimeError("no update path yet: the strategy gives the executor one at setup (use_path)")
        return self.path.sink

    @property
    def updates(self) -> Any:
        """The engine's update queue, or None when the user's optimizer is stepped by Lightning."""
        return self.path.updates if self.path is not None else None

    @property
    def device_update_reserve_bytes(self) -> int:
        return self.path.device_reserve_bytes if self.path is not None else 0

    @property
    def device_update_held_bytes(self) -> int:
        return self.path.device_held_bytes if self.path is not None else 0

    @property
    def fused_modules(self) -> int:
        """Submodules of the streamed layers running Liger's kernels (``models/fused_kernels.py``)."""
        return fused_count(self.layers)

    @property
    def resident_device_bytes(self) -> int:
        """Device bytes of the resident embedding/norm/head copy and its gradients."""
        return 2 * self._resident_buf.numel() * self._resident_buf.element_size()

    def set_plan(self, plan: Schedule, num_slots: int | None = None) -> None:
        """Adopt ``plan``: size the weight slot pool for it and open the activation homes it names."""
        if plan.num_layers != self.adapter.num_layers:
            raise ValueError(f"the plan covers {plan.num_layers} layers but the model has {self.adapter.num_layers}")
        slots = num_slots or plan.slots_needed(self.prefetch_depth)
        if slots < plan.slots_needed(1):
            raise ValueError(f"this plan needs at least {plan.slots_needed(1)} weight slots, got num_slots={slots}")
        if self.homes is not None:
            self.homes.close()
        self.plan = plan
        if self.pool is None or len(self.pool.slots) != slots:
            self.pool = None
            self._check_device_fits(slots, self.slot_numel, self.store.stream_dtype)
            try:
                self.pool = SlotPool(self.queues, self.store.versions, slots, self.slot_numel, self.store.stream_dtype)
            except torch.OutOfMemoryError as err:
                raise DeviceTooSmallError(self._slots_message(slots, self.slot_numel, self.store.stream_dtype)) from err
        self.homes = ActivationHomes(self.queues, plan.homes, self.store.pinned, self.spill_dir, self.timeout_s)

    def unhooked(self) -> AbstractContextManager[None]:
        """The layers' own forwards, for code that copies or runs a layer itself (the profiler)."""
        return self.hooks.unhooked()

    def record(self, index: int, call: LayerCall) -> None:
        """A decoder layer's call, recorded by its hook; the stack runs them all when the final norm asks."""
        if index == 0:
            self._pending = []
        self._pending.append(call)

    def _check_device_fits(self, slots: int, slot_numel: int, dtype: torch.dtype) -> None:
        if self.device.type != "cuda":
            return
        if (slots * slot_numel + 2 * self.resident_unit.numel) * dtype.itemsize > device_free_bytes(self.device):
            raise DeviceTooSmallError(self._slots_message(slots, slot_numel, dtype))

    def _slots_message(self, slots: int, slot_numel: int, dtype: torch.dtype) -> str:
        item = dtype.itemsize
        need = (slots * slot_numel + 2 * self.resident_unit.numel) * item
        return (
            f"{slots} weight slots of {slot_numel * item / 2**30:.2f} GiB plus the resident embedding/head"
            f" ({2 * self.resident_unit.numel * item / 2**30:.2f} GiB with gradients) need {need / 2**30:.2f} GiB,"
            f" but {self.device} has {device_free_bytes(self.device) / 2**30:.2f} GiB free. Use a plan with fewer"
            " resident layers (smaller keep_graph_layers / interval) or a larger GPU."
        )

    def close(self) -> None:
        """Give the model back as it was (forwards, buffers on their old device), release pinned memory."""
        self.hooks.remove()
        unfuse_decoder_kernels(self.layers)
        if self.path is not None:
            self.path.close()
            self.path = None
        if self.homes is not None:
            self.homes.close()
        self.store.close()

    def resident_tensors(self) -> list[torch.Tensor]:
        """The device copy of embedding/norm/head as autograd leaves, re-uploaded after the masters changed."""
        unit = self.resident_unit
        generation = self.store.versions.refresh(unit)
        if self._resident_leaves is None or self._resident_generation != generation:
            # A validation loop may be first to run, under inference mode; these leaves must outlive it.
            with torch.inference_mode(False):
                self._resident_buf.copy_(unit.stream, non_blocking=True)
                views = [e.view_in(self._resident_buf) for e in unit.unique]
                self._resident_leaves = leaves_of(views, unit)
            self._resident_generation = generation
        return self._resident_leaves

    def run_stack(self, hidden: torch.Tensor) -> torch.Tensor:
        calls, self._pending = self._pending, []
        self.batch_rows = hidden.shape[0]
        if len(calls) != len(self.layers):
            raise RuntimeError(f"lazytrain saw {len(calls)} of {len(self.layers)} decoder layer calls before the norm")
        device_type = self.device.type
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        context = StackContext(
            self.layers, self.layer_units, self.pool, self.queues, self.homes, self.plan, self.sink, self.prefetch_depth
        )
        run = StackRun(context, calls, autocast)
        if torch.is_grad_enabled():
            return StreamedStack.apply(hidden, self._anchor, run)
        return run.forward(hidden, training=False)

    def after_backward(self) -> None:
        """Drain the resident gradients and wait until every gradient is in its host accumulator."""
        leaves = self._resident_leaves or []
        grads = [leaf.grad for leaf in leaves]
        if any(g is not None for g in grads):
            self.sink.submit(self.resident_unit, grads)
            for leaf in leaves:
                leaf.grad = None
        self.sink.flush()

    def after_optimizer_step(self) -> None:
        if self.updates is None:
            self.store.versions.masters_changed()

    def host_state_loaded(self, masters: bool) -> None:
        """A checkpoint load rewrote the host masters (``masters``) or replaced the optimizer states: the streamed
        copies and any device copy of them are refreshed before they are read again."""
        if masters:
            self.store.versions.masters_changed()
        if self.path is not None:
            self.path.host_state_changed()

    def direct_step(self, clip_val: float | None, guard: NonFiniteGuard, step: int) -> bool:
        """Queue this step's engine updates; False when a non-finite gradient norm skips the step."""
        assert self.path is not None
        return self.path.step(clip_val, guard, step)

    def wait_updates(self) -> None:
        if self.path is not None:
            self.path.wait()

    def discard_step(self) -> None:
        """Forget what a step that failed half-way left behind: its gradients (landed or queued), the resident
        leaves' gradients, recorded layer calls, and the slot pool (slots it acquired are never released)."""
        if self.path is not None:
            self.path.discard()
        for leaf in self._resident_leaves or []:
            leaf.grad = None
        self._pending = []
        self.pool = None

    def model_state(self) -> dict[str, Any] | None:
        """A checkpoint's model state when the store's own layout is saved (shards), else None: the module's."""
        self.wait_updates()
        return self.store.checkpoint_state()

    def load_model_state(self, state: dict[str, Any]) -> bool:
        """Load ``model_state()``'s dict into the store; False when the module's ``load_state_dict`` is the way."""
        self.wait_updates()
        return self.store.load_checkpoint_state(state)

    def optimizer_state(self) -> dict[str, Any] | None:
        """A checkpoint's optimizer state when the engine's own optimizer holds it (shards), else None."""
        self.wait_updates()
        return self.path.optimizer_state() if self.path is not None else None

    def load_optimizer_state(self, state: dict[str, Any]) -> bool:
        return self.path is not None and self.path.load_optimizer_state(state)

    def take_stats(self) -> dict[str, float]:
        """Transfer counters since the previous call (one optimizer step when called once per step)."""
        now = (self.pool.h2d_copies, self.pool.h2d_bytes, self.sink.d2h_bytes)
        before, self._stats_mark = getattr(self, "_stats_mark", (0, 0, 0)), now
        copies, h2d, d2h = (a - b for a, b in zip(now, before))
        homes = self.homes.take_stats() if self.homes is not None else {}
        waited = self.store.versions.take_wait_seconds()
        busy, device_launch = self.updates.take_busy_seconds() if self.updates is not None else (0.0, 0.0)
        gpu = self.queues.take_busy_idle_seconds()  # CUDA events; absent on the CPU
        gpu_stats = {} if gpu is None else {"gpu_layer_busy_s": gpu[0], "gpu_idle_s": gpu[1]}
        return {**gpu_stats, "layer_h2d_copies": float(copies), "h2d_gib": h2d / 2**30, "d2h_gib": d2h / 2**30,
                "stall_s": self.queues.take_stall_seconds(), "update_wait_s": waited,
                "update_busy_s": busy, "device_update_launch_s": device_launch,
                **{f"act_{k}": float(v) for k, v in homes.items() if k != "host_buffers"}}

    def head_weight(self) -> torch.Tensor:
        unit, head = self.resident_unit, self.adapter.lm_head
        uid = next(e.uid for e in unit.entries if e.module is head and e.name == "weight")
        return self.resident_tensors()[uid]


def _resident_modules(adapter: ModelAdapter) -> list[nn.Module]:
    layer_ids = {id(m) for layer in adapter.layers for m in layer.modules()}
    return [m for m in adapter.model.modules() if id(m) not in layer_ids and any(True for _ in m._parameters)]
