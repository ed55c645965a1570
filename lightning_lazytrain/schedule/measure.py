"""What `profile_model` measures on the device: each layer kind's times and memory, and the head's time.

One copy of one layer per group of layers with the same kind and parameter shapes; CUDA events time it
(``timer``), and the copies are freed before the plan reads the free memory.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.compute.gradient_only_linear import mlp_output_skipped
from lightning_lazytrain.models.adapter import ModelAdapter

from .layer_memory import measure_layer_memory, measure_mlp_recompute_graph, rows_scaled_working_bytes, trainable_bytes
from .timing import rotary_inputs, time_cuda

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerMeasurement:
    """One layer's measured facts (the `Profile` fields of the same names, for that layer)."""

    forward_seconds: float
    rerun_seconds: float
    graph_bytes: int
    working_bytes: int
    mlp_seconds: float
    mlp_graph_bytes: int


def layer_groups(adapter: ModelAdapter) -> dict[tuple, list[int]]:
    """Layers grouped by (layer type, parameter names and shapes): one measurement per group."""
    types = adapter.layer_types()
    groups: dict[tuple, list[int]] = {}
    for j, layer in enumerate(adapter.layers):
        shapes = tuple((name, tuple(p.shape)) for name, p in layer.named_parameters())
        groups.setdefault((types[j], shapes), []).append(j)
    return groups


def measure_layers(adapter: ModelAdapter, batch: int, seq: int, device: torch.device, dtype,
                   timer=time_cuda) -> dict[int, LayerMeasurement]:
    """Per layer index: seconds of one no-grad forward and of one without the MLP's output projection (what the
    backward's re-run computes), both timed with ``timer``; seconds of one no-grad MLP forward; on CUDA the graph
    and peak working bytes of a forward-with-grad + backward and the graph bytes with the MLP re-run in the
    backward (0 elsewhere)."""
    hidden = adapter.model.config.hidden_size
    rotary = copy.deepcopy(adapter.rotary).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(batch, seq, hidden, device=device, dtype=dtype, generator=gen)
    pos, pe = rotary_inputs(rotary, h, batch, seq)
    kwargs = {"attention_mask": None, "position_ids": pos, "position_embeddings": pe}
    out: dict[int, LayerMeasurement] = {}
    for (_, _), members in layer_groups(adapter).items():
        layer = copy.deepcopy(adapter.layers[members[0]]).to(device=device, dtype=dtype).eval()
        with torch.no_grad():
            secs = timer(lambda layer=layer: layer(h, **kwargs), device)
            with mlp_output_skipped(layer):
                rerun = timer(lambda layer=layer: layer(h, **kwargs), device)
            mlp_secs = timer(lambda layer=layer: layer.mlp(h), device)  # the MLP sees a hidden-sized input
        cuda = device.type == "cuda"
        graph, peak = measure_layer_memory(layer, h, kwargs) if cuda else (0, 0)
        partial = measure_mlp_recompute_graph(layer, h, kwargs) if cuda else 0
        del layer
        for j in members:
            out[j] = LayerMeasurement(forward_seconds=secs, rerun_seconds=min(rerun, secs), graph_bytes=graph,
                                      working_bytes=peak, mlp_seconds=mlp_secs, mlp_graph_bytes=partial)
    # a submodule with a fused kernel's bound forward is a reference cycle: free the copies' device weights now,
    # before the plan reads the free memory and the steps run beside them
    gc.collect()
    return out


def measure_layers_fitting(adapter: ModelAdapter, batch: int, seq: int, device: torch.device, dtype,
                           measure: Callable[..., dict[int, LayerMeasurement]] = measure_layers,
                           ) -> tuple[dict[int, LayerMeasurement], int]:
    """``measure`` at ``batch`` rows, or, where one whole-batch layer does not fit the device (the batches that
    layer micro-batches exist for), at half the rows and again, scaled to ``batch``. Returns the measurements and
    the rows measured.

    Scaling: times, graphs and the per-token part of the working set grow with the rows; the working set's
    weight gradients (the layer's trainable parameter bytes, none for a frozen layer) do not. Times measured on
    fewer rows are per row no faster, so the scaled times are an upper estimate."""
    rows = batch
    while True:
        try:
            measured = measure(adapter, rows, seq, device, dtype)
            break
        except torch.OutOfMemoryError:
            if rows == 1:
                raise
        # out of the except block: the failed measurement's tensors are gone with its frames
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows = (rows + 1) // 2
    if rows == batch:
        return measured, rows
    log.info("lazytrain: one layer at %d x %d does not fit the device; profiled at %d rows and scaled", batch, seq,
             rows)
    scale = batch / rows

    def scaled(j: int, m: LayerMeasurement) -> LayerMeasurement:
        return dataclasses.replace(
            m, forward_seconds=m.forward_seconds * scale, rerun_seconds=m.rerun_seconds * scale,
            mlp_seconds=m.mlp_seconds * scale, graph_bytes=round(m.graph_bytes * scale),
            mlp_graph_bytes=round(m.mlp_graph_bytes * scale),
            working_bytes=rows_scaled_working_bytes(m.working_bytes, trainable_bytes(adapter.layers[j], dtype.itemsize),
                                                    scale))

    return {j: scaled(j, m) for j, m in measured.items()}, rows


def measure_head(adapter: ModelAdapter, tokens: int, device: torch.device, dtype, timer=time_cuda) -> float:
    """lm_head + cross-entropy forward and backward on a chunk of <= 4096 tokens, scaled to ``tokens``; the
    head's weight gradient only where it trains (a LoRA run's frozen head computes none)."""
    head = adapter.lm_head.weight
    chunk = min(tokens, 4096)
    w = head.detach().to(device=device, dtype=dtype).requires_grad_(head.requires_grad)
    x = torch.randn(chunk, head.shape[1], device=device, dtype=dtype, requires_grad=True)
    y = torch.randint(0, head.shape[0], (chunk,), device=device)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy((x @ w.t()).float(), y)
        loss.backward()

    return timer(step, device) * tokens / chunk
