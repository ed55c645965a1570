"""The decoder stack as one autograd Function: layers stream through device slots in the forward and backward.

The model's own forward still builds masks, rotary tables and position ids; each decoder layer call is only
recorded (``LayerCall``), and the whole recorded stack runs here when the final norm asks for its input. The
backward walks the plan's blocks from the top: reload or rebuild each layer's input, run it with grad (its MLP's
output projection skipped, `gradient_only_linear.py`), hand its weight gradients to the ``GradSink`` and pass the
input gradient down.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from lightning_lazytrain.engine.activations.homes import ActivationHomes
from lightning_lazytrain.engine.compute.gradient_only_linear import mlp_output_skipped
from lightning_lazytrain.engine.compute.micro_batches import SummedGrads, row_slices, split_call
from lightning_lazytrain.engine.compute.mlp_recompute import checkpointed_mlp
from lightning_lazytrain.engine.compute.rng import RngState, capture_rng, restore_rng, rng_fork
from lightning_lazytrain.engine.device import DeviceQueues
from lightning_lazytrain.engine.plan import Schedule
from lightning_lazytrain.engine.weights.binding import bound, leaves_of
from lightning_lazytrain.engine.weights.layout import ParamUnit
from lightning_lazytrain.engine.weights.slots import Slot, SlotPool


class WeightGradSink(Protocol):
    """Where a layer's weight gradients go once its backward ran (the host, direct or sharded sink)."""

    def submit(self, unit: ParamUnit, grads: list[torch.Tensor | None]) -> None: ...


@dataclass
class LayerCall:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class _Graph:
    inputs: torch.Tensor
    output: torch.Tensor
    leaves: list[torch.Tensor]
    slot: Slot


@dataclass(frozen=True)
class StackContext:
    """What one run of the stack works with; the executor builds one per forward from its current plan and pool."""

    layers: list[nn.Module]
    units: list[ParamUnit]
    pool: SlotPool
    queues: DeviceQueues
    homes: ActivationHomes
    plan: Schedule
    sink: WeightGradSink
    prefetch_depth: int

    @property
    def device(self) -> torch.device:
        return self.queues.device

    def prefetcher(self, order: list[int]):
        return self.pool.prefetcher([self.units[j] for j in order], self.prefetch_depth)


@dataclass
class StackRun:
    """One forward of the stack and what it keeps for the backward."""

    ctx: StackContext
    calls: list[LayerCall]
    autocast: tuple[bool, torch.dtype] = (False, torch.bfloat16)
    graphs: dict[int, _Graph] = field(default_factory=dict)
    rows: int = 0  # the batch's rows, which the layer calls' batch-sized tensors have
    # the generators' states before each layer that runs again in the backward (dropout draws the same masks)
    rng: dict[int, RngState] = field(default_factory=dict)

    def _autocast(self) -> contextlib.AbstractContextManager:
        enabled, dtype = self.autocast
        return torch.autocast(self.ctx.device.type, dtype=dtype, enabled=enabled)

    def _rows(self, hidden: torch.Tensor) -> list[slice]:
        return row_slices(hidden.shape[0], self.ctx.plan.micro_batches)

    def _call(self, j: int, hidden: torch.Tensor, part: slice, weights: list[torch.Tensor]) -> torch.Tensor:
        """Layer j on the rows ``part`` of the batch; ``hidden`` holds those rows only."""
        ex = self.ctx
        layer, call = ex.layers[j], self.calls[j]
        args, kwargs = split_call(call.args, call.kwargs, self.rows, part)
        with bound(ex.units[j], weights), ex.queues.busy():
            out = type(layer).forward(layer, hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def _layer(self, j: int, hidden: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """Layer j over the batch, one micro-batch after the other. With grad (a kept graph) autograd joins the
        slices, and its backward runs them one after the other too (their nodes are created in that order);
        without, each slice's output is written into the batch's as it comes."""
        parts = self._rows(hidden)
        if len(parts) == 1:
            return self._call(j, hidden, parts[0], weights)
        if torch.is_grad_enabled():
            return torch.cat([self._call(j, hidden[part], part, weights) for part in parts])
        out = None
        for part in parts:
            piece = self._call(j, hidden[part], part, weights)
            if out is None:
                out = piece.new_empty((hidden.shape[0], *piece.shape[1:]))
            out[part] = piece
        return out

    def _acquire(self, j: int) -> Slot:
        ex = self.ctx
        slot = ex.pool.acquire(ex.units[j])
        ex.queues.wait(slot.ready)
        return slot

    def forward(self, hidden: torch.Tensor, training: bool) -> torch.Tensor:
        ex, plan = self.ctx, self.ctx.plan
        self.rows = hidden.shape[0]
        order = list(range(len(self.calls)))
        prefetch = ex.prefetcher(order)
        homes = ex.homes
        if training and self._needed(0):
            homes.put(0, hidden)
        x = hidden
        for j in order:
            slot = self._acquire(j)
            if training and plan.keep_graph[j]:
                partial = checkpointed_mlp(ex.layers[j]) if plan.mlp_recompute[j] else contextlib.nullcontext()
                with torch.enable_grad(), partial:
                    inputs = x.detach().requires_grad_()
                    leaves = leaves_of(slot.views(ex.units[j]), ex.units[j])
                    out = self._layer(j, inputs, leaves)
                self.graphs[j] = _Graph(inputs, out, leaves, slot)
                x = out.detach()
            else:
                if training:
                    self.rng[j] = capture_rng(ex.device)
                x = self._layer(j, x, slot.views(ex.units[j]))
                ex.pool.release(slot)
            # queue this layer's compute before possibly blocking on the next layer's optimizer update
            prefetch(j + 1)
            if training and self._needed(j + 1):
                homes.put(j + 1, x)
        if training:
            homes.flush()
            # the backward's first block that reads its input back: bring that input back while the head runs
            first = self._next_read_back([s for s, _ in reversed(plan.blocks())], -1)
            if first is not None:
                homes.prefetch(first)
        ex.queues.end_span()
        return x

    def _needed(self, boundary: int) -> bool:
        """Boundary i is read back in the backward when it starts a block whose layer re-runs there."""
        plan = self.ctx.plan
        return boundary < plan.num_layers and plan.kept(boundary) and not plan.keep_graph[boundary]

    def _next_read_back(self, starts: list[int], k: int) -> int | None:
        """The input of the first block after the k-th (backward order) that reads its input back. Kept graphs in
        between read nothing back, so looking only at the next block would leave that reload to start at its
        ``get``, with no compute left to hide behind."""
        return next((s for s in starts[k + 1 :] if self._needed(s)), None)

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        with rng_fork(self.ctx.device):
            return self._backward(grad)

    def _rerun(self, j: int, hidden: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        restore_rng(self.rng[j], self.ctx.device)
        return self._layer(j, hidden, weights)

    def _backward(self, grad: torch.Tensor) -> torch.Tensor:
        ex, plan = self.ctx, self.ctx.plan
        blocks = list(reversed(plan.blocks()))
        order = [j for s, e in blocks for j in range(s, e)]
        prefetch = ex.prefetcher(order)
        cursor = 0
        starts = [s for s, _ in blocks]
        for k, (s, e) in enumerate(blocks):
            below = self._next_read_back(starts, k)
            if e == s + 1 and s in self.graphs:
                graph = self.graphs.pop(s)
                cursor += 1
                prefetch(cursor)
                if below is not None:
                    ex.homes.prefetch(below)
                grad = self._backprop(s, graph.output, graph.inputs, graph.leaves, grad)
                ex.pool.release(graph.slot)
                continue
            slots = [self._acquire(j) for j in range(s, e)]
            cursor += e - s
            prefetch(cursor)
            inputs = [ex.homes.get(s)]
            if below is not None:
                ex.homes.prefetch(below)
            with torch.no_grad(), self._autocast():
                for j in range(s, e - 1):
                    inputs.append(self._rerun(j, inputs[-1], slots[j - s].views(ex.units[j])))
            for j in reversed(range(s, e)):
                grad = self._grad_rerun(j, inputs.pop(), slots[j - s], grad)
                ex.pool.release(slots[j - s])
                prefetch(cursor)
        ex.homes.clear()
        self.rng.clear()
        ex.queues.end_span()
        return grad

    def _grad_rerun(self, j: int, hidden: torch.Tensor, slot: Slot, grad: torch.Tensor) -> torch.Tensor:
        """Layer j run with grad and back-propagated one micro-batch at a time, so that only one micro-batch's
        graph is alive; the weight gradients are summed and handed to the sink once, the input gradients written
        into the batch's as they come."""
        ex, unit = self.ctx, self.ctx.units[j]
        leaves = leaves_of(slot.views(unit), unit)
        restore_rng(self.rng[j], ex.device)
        parts = self._rows(hidden)
        summed = SummedGrads()
        grad_in = torch.empty_like(hidden) if len(parts) > 1 else None
        for part in parts:
            # only the output's gradient is used: the MLP's output projection is not multiplied out
            with torch.enable_grad(), self._autocast(), mlp_output_skipped(ex.layers[j]):
                x = hidden[part].detach().requires_grad_()
                out = self._call(j, x, part, leaves)
            piece, weight_grads = self._grads(out, x, leaves, grad[part])
            summed.add(weight_grads)
            if grad_in is None:  # one slice: its input gradient is the batch's
                grad_in = piece
            else:
                grad_in[part] = piece
        ex.sink.submit(unit, summed.total)
        return grad_in

    def _backprop(self, j: int, out: torch.Tensor, x: torch.Tensor, leaves: list[torch.Tensor], grad: torch.Tensor):
        grad_in, weight_grads = self._grads(out, x, leaves, grad)
        self.ctx.sink.submit(self.ctx.units[j], weight_grads)
        return grad_in

    def _grads(self, out: torch.Tensor, x: torch.Tensor, leaves: list[torch.Tensor],
               grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Back-propagate ``out``: its input gradient, and one weight gradient per leaf (None where frozen)."""
        trainable = [leaf for leaf in leaves if leaf.requires_grad]
        with self.ctx.queues.busy():
            grads = torch.autograd.grad(out, [x, *trainable], grad, allow_unused=True)
        it = iter(grads[1:])
        weight_grads = [next(it) if leaf.requires_grad else None for leaf in leaves]
        return (grads[0] if grads[0] is not None else torch.zeros_like(x)), weight_grads


class StreamedStack(torch.autograd.Function):
    """``anchor`` is an empty leaf that requires grad, so the backward runs even when the stack's input does not
    need a gradient (a frozen embedding) but the layers do."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, anchor: torch.Tensor, run: StackRun) -> torch.Tensor:
        ctx.run = run
        return run.forward(hidden, training=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        run, ctx.run = ctx.run, None
        return run.backward(grad), None, None
