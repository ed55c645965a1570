"""The streaming executor: owns the host store, the weight slots and the gradient sink, and hooks the HF model.

Hooks are instance-level ``forward`` overrides, so module names, parameters and ``state_dict`` stay exactly those
of the user's model. Decoder layers only record their call; the final norm runs the recorded stack (one autograd
Function); the embedding, norm and head run on a device-resident bf16 copy whose gradients are drained to the host
after each backward. With labels, the causal-LM forward routes the loss through the chunked head.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from lightning_lazytrain.engine.activations.homes import ActivationHomes
from lightning_lazytrain.engine.device import DeviceQueues, device_free_bytes
from lightning_lazytrain.engine.grads.direct import DirectGradSink
from lightning_lazytrain.engine.grads.host import GradSink
from lightning_lazytrain.engine.grads.sharded import ShardedGradSink
from lightning_lazytrain.engine.loss import chunked_causal_lm_loss, chunked_token_accuracy
from lightning_lazytrain.engine.plan import StackPlan
from lightning_lazytrain.engine.stack import LayerCall, StackContext, StackRun, StreamedStack
from lightning_lazytrain.engine.updates.cpu import UpdateQueue
from lightning_lazytrain.engine.updates.device import DeviceUpdatePath, assign_device_updates
from lightning_lazytrain.engine.updates.sharded import ShardedUpdateQueue
from lightning_lazytrain.engine.weights.binding import bound, leaves_of
from lightning_lazytrain.engine.weights.slots import SlotPool
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.models import ModelAdapter
from lightning_lazytrain.optim import NonFiniteGuard, clip_coefficient


@dataclass
class StreamedCausalLMOutput(CausalLMOutputWithPast):
    """The loss without logits (they never exist); in no-grad passes also the teacher-forced token accuracy."""

    token_accuracy: torch.Tensor | None = None


class DeviceTooSmallError(RuntimeError):
    """The weight slots and resident parts alone do not fit the device."""


class StreamingExecutor:
    def __init__(
        self,
        adapter: ModelAdapter,
        device: torch.device,
        master_dtype: torch.dtype,
        stream_dtype: torch.dtype,
        plan: StackPlan,
        num_slots: int | None = None,
        prefetch_depth: int = 2,
        pin_memory: bool = True,
        timeout_s: float = 600.0,
        loss_chunk_bytes: int = 1 << 29,
        spill_dir: str | None = None,
        store_factory: Callable[..., HostParamStore] = HostParamStore,
    ) -> None:
        if getattr(adapter.lm_head, "bias", None) is not None:
            raise ValueError("lazytrain's chunked loss supports a bias-free lm_head only (all supported families)")
        self.adapter, self.device = adapter, device
        self.prefetch_depth, self.loss_chunk_bytes = prefetch_depth, loss_chunk_bytes
        self.spill_dir, self.timeout_s = spill_dir, timeout_s
        self.queues = DeviceQueues(device)
        self.layers: list[nn.Module] = list(adapter.layers)
        self.resident_modules = _resident_modules(adapter)
        groups = [("resident", self.resident_modules)] + [(f"layer.{j}", [m]) for j, m in enumerate(self.layers)]
        self.store = store_factory(groups, master_dtype, stream_dtype, pin=pin_memory and device.type == "cuda")
        self.resident_unit, self.layer_units = self.store.units[0], self.store.units[1:]
        self.slot_numel = max(u.numel for u in self.layer_units)
        self.pool: SlotPool | None = None
        self.homes: ActivationHomes | None = None
        self.set_plan(plan, num_slots)
        slot_numel, stream_dtype = self.slot_numel, self.store.stream_dtype
        self.sink: GradSink | DirectGradSink | ShardedGradSink = GradSink(
            self.store, self.queues, slot_numel, stream_dtype, timeout_s=timeout_s
        )
        self.updates: UpdateQueue | ShardedUpdateQueue | None = None
        self.device_update_reserve_bytes = 0
        self._resident_buf = torch.empty(self.resident_unit.numel, dtype=stream_dtype, device=device)
        self._resident_leaves: list[torch.Tensor] | None = None
        self._resident_generation = -1
        self._anchor = torch.empty(0, device=device, requires_grad=True)
        self._pending: list[LayerCall] = []
        self._saved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []
        self._patched: list[tuple[nn.Module, bool]] = []
        self._install()

    def set_plan(self, plan: StackPlan, num_slots: int | None = None) -> None:
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
                self.pool = SlotPool(self.queues, slots, self.slot_numel, self.store.stream_dtype)
            except torch.OutOfMemoryError as err:
                raise DeviceTooSmallError(self._slots_message(slots, self.slot_numel, self.store.stream_dtype)) from err
        self.homes = ActivationHomes(self.queues, plan.homes, self.store.pinned, self.spill_dir, self.timeout_s)

    @contextlib.contextmanager
    def unhooked(self) -> Iterator[None]:
        """The layers' own forwards, for code that copies or runs a layer itself (the profiler)."""
        own = [(m, m.__dict__.pop("forward")) for m, _ in self._patched if "forward" in m.__dict__]
        try:
            yield
        finally:
            for module, forward in own:
                module.forward = forward

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

    def _install(self) -> None:
        model = self.adapter.model
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.device != self.device:
                    self._saved_buffers.append((module, name, buf))
                    module._buffers[name] = buf.to(self.device)
        for j, layer in enumerate(self.layers):
            self._patch(layer, types.MethodType(_recorder(self, j), layer))
            if hasattr(layer, "gradient_checkpointing"):
                layer.gradient_checkpointing = False
        for module in self.resident_modules:
            fn = _norm_forward if module is self.adapter.final_norm else _resident_forward
            self._patch(module, types.MethodType(_bind_resident(self, fn), module))
        self._original_forward = types.MethodType(type(model).forward, model)
        self._patch(model, types.MethodType(_causal_lm_forward(self), model))

    def _patch(self, module: nn.Module, forward: Any) -> None:
        self._patched.append((module, "forward" in module.__dict__))
        module.forward = forward

    def close(self) -> None:
        """Give the model back as it was (forwards, buffers on their old device), release pinned memory."""
        for module, had_own in reversed(self._patched):
            if not had_own:
                del module.forward
        self._patched.clear()
        if self.updates is not None:
            self.updates.close()
        if self.homes is not None:
            self.homes.close()
        for module, name, buf in self._saved_buffers:
            module._buffers[name] = buf
        self._saved_buffers.clear()
        self.sink.close()
        self.store.close()

    def resident_tensors(self) -> list[torch.Tensor]:
        """The device copy of embedding/norm/head as autograd leaves, re-uploaded after the masters changed."""
        unit = self.resident_unit
        unit.refresh_stream()
        if self._resident_leaves is None or self._resident_generation != unit.generation:
            # A validation loop may be first to run, under inference mode; these leaves must outlive it.
            with torch.inference_mode(False):
                self._resident_buf.copy_(unit.stream, non_blocking=True)
                views = [self._resident_buf[e.offset : e.offset + e.numel].view(e.shape) for e in unit.unique]
                self._resident_leaves = leaves_of(views, unit)
            self._resident_generation = unit.generation
        return self._resident_leaves

    def run_stack(self, hidden: torch.Tensor) -> torch.Tensor:
        calls, self._pending = self._pending, []
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
            self.store.mark_dirty()

    def enable_direct_updates(self, optimizer: torch.optim.Optimizer, device_update_share: float | None = None) -> None:
        """Let the engine run ``optimizer.step_params`` per unit from bf16 host gradients, off the main thread.

        ``device_update_share``: the share of parameters whose update runs on the GPU beside the CPU's
        (``engine/updates/device.py``); ``None`` picks it from the measured CPU update and link rates on CUDA and
        is 0 on the CPU.
        """
        units = self.store.units
        itemsize = self.store.stream_dtype.itemsize
        self.device_update_reserve_bytes = assign_device_updates(units, optimizer, device_update_share, self.device,
                                                                 itemsize)
        self.sink.close()
        self.sink = DirectGradSink(self.store, self.queues, self.store.stream_dtype)
        managed = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if self.store.master_dtype != self.store.stream_dtype:
            for unit in units:
                for e in unit.unique:
                    if id(e.param) in managed:
                        copy = unit.stream[e.offset : e.offset + e.numel].view(e.shape)
                        optimizer.register_stream_copy(e.param, copy)
        on_device = any(u.update_on_device for u in units)
        path = DeviceUpdatePath(optimizer, units, self.queues, self.timeout_s) if on_device else None
        self.updates = UpdateQueue(optimizer, units, self.timeout_s, path)

    def enable_sharded_updates(self, optimizer: torch.optim.Optimizer) -> None:
        """Several processes (a ``SharedParamStore``): gradients are reduce-scattered on the device, each rank
        updates its own shard of every unit with a shard optimizer built from ``optimizer``."""
        self.sink.close()
        self.sink = ShardedGradSink(self.store, self.queues, self.store.stream_dtype)
        self.updates = ShardedUpdateQueue(optimizer, self.store, self.timeout_s)

    def direct_step(self, clip_val: float | None, guard: NonFiniteGuard, step: int) -> bool:
        """Queue this step's updates (clipped by the device-side norm); False when a non-finite norm skips it."""
        assert self.updates is not None and isinstance(self.sink, (DirectGradSink, ShardedGradSink))
        norm_sq = self.sink.take_norm_sq()
        if not guard.check(norm_sq, step):
            for unit in self.store.units:
                unit.has_grads = False
            return False
        coef = clip_coefficient(norm_sq, clip_val) if clip_val else 1.0
        self.updates.schedule(coef)
        return True

    def wait_updates(self) -> None:
        if self.updates is not None:
            self.updates.wait_all()

    def take_stats(self) -> dict[str, float]:
        """Transfer counters since the previous call (one optimizer step when called once per step)."""
        now = (self.pool.h2d_copies, self.pool.h2d_bytes, self.sink.d2h_bytes)
        before, self._stats_mark = getattr(self, "_stats_mark", (0, 0, 0)), now
        copies, h2d, d2h = (a - b for a, b in zip(now, before))
        homes = self.homes.stats() if self.homes is not None else {}
        waited = sum(u.update_wait_seconds for u in self.store.units)
        busy = sum(u.update_busy_seconds for u in self.store.units if not u.update_on_device)
        device_busy = sum(u.update_busy_seconds for u in self.store.units if u.update_on_device)
        for unit in self.store.units:
            unit.update_wait_seconds = unit.update_busy_seconds = 0.0
        gpu = self.queues.take_busy_idle_seconds()  # CUDA events; absent on the CPU
        gpu_stats = {} if gpu is None else {"gpu_layer_busy_s": gpu[0], "gpu_idle_s": gpu[1]}
        return {**gpu_stats, "layer_h2d_copies": float(copies), "h2d_gib": h2d / 2**30, "d2h_gib": d2h / 2**30,
                "stall_s": self.queues.take_stall_seconds(), "update_wait_s": waited,
                "update_busy_s": busy, "device_update_busy_s": device_busy,
                **{f"act_{k}": float(v) for k, v in homes.items() if k != "host_buffers"}}

    def head_weight(self) -> torch.Tensor:
        unit, head = self.resident_unit, self.adapter.lm_head
        uid = next(e.uid for e in unit.entries if e.module is head and e.name == "weight")
        return self.resident_tensors()[uid]


def _resident_modules(adapter: ModelAdapter) -> list[nn.Module]:
    layer_ids = {id(m) for layer in adapter.layers for m in layer.modules()}
    return [m for m in adapter.model.modules() if id(m) not in layer_ids and any(True for _ in m._parameters)]


def _recorder(executor: StreamingExecutor, j: int):
    def record(layer: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if j == 0:
            executor._pending = []
        executor._pending.append(LayerCall(args, kwargs))
        return hidden

    return record


def _bind_resident(executor: StreamingExecutor, fn):
    def forward(module: nn.Module, *args: Any, **kwargs: Any):
        return fn(executor, module, *args, **kwargs)

    return forward


def _resident_forward(executor: StreamingExecutor, module: nn.Module, *args: Any, **kwargs: Any):
    with bound(executor.resident_unit, executor.resident_tensors()):
        return type(module).forward(module, *args, **kwargs)


def _norm_forward(executor: StreamingExecutor, module: nn.Module, hidden: torch.Tensor, *args: Any, **kwargs: Any):
    return _resident_forward(executor, module, executor.run_stack(hidden), *args, **kwargs)


def _on_device(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) and value.device != device else value


def _causal_lm_forward(executor: StreamingExecutor):
    def forward(model: nn.Module, input_ids=None, attention_mask=None, position_ids=None, *args: Any, **kwargs: Any):
        # The HF model's parameters live on the host, so ``model.device`` says CPU and ``generate`` builds some of
        # its inputs (cache positions, the next step's ids) there; the layers run on the executor's device.
        input_ids, attention_mask, position_ids = (_on_device(t, executor.device)
                                                   for t in (input_ids, attention_mask, position_ids))
        args = tuple(_on_device(a, executor.device) for a in args)
        kwargs = {k: _on_device(v, executor.device) for k, v in kwargs.items()}
        labels = kwargs.pop("labels", None)
        if labels is None:
            return executor._original_forward(input_ids, attention_mask, position_ids, *args, **kwargs)
        if args:
            raise TypeError("with labels, pass the model's other inputs by keyword (input_ids=..., attention_mask=...)")
        for flag in ("output_hidden_states", "output_attentions"):
            if kwargs.pop(flag, False):
                raise ValueError(f"lazytrain streams the decoder layers and does not return {flag}")
        num_items = kwargs.pop("num_items_in_batch", None)
        for unused in ("use_cache", "cache", "past_key_values", "logits_to_keep", "return_dict"):
            kwargs.pop(unused, None)
        out = executor.adapter.decoder(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **kwargs
        )
        hidden, weight = out.last_hidden_state, executor.head_weight()
        loss = chunked_causal_lm_loss(hidden, weight, labels, num_items, executor.loss_chunk_bytes)
        accuracy = None
        if not torch.is_grad_enabled():
            accuracy = chunked_token_accuracy(hidden, weight, labels, executor.loss_chunk_bytes)
        return StreamedCausalLMOutput(loss=loss, logits=None, token_accuracy=accuracy)

    return forward
