"""`profile_model` for a model that has no weights (built on the meta device), measured on this CUDA device.

A copy of the model with one decoder layer per layer kind is built on the device with random weights (the
embeddings and head included), profiled as usual, and its per-kind layer times are spread over the full model's
layers; bytes come from the full model's shapes. Where the model's base is frozen (LoRA), the copy's layers and
head are frozen likewise, so their working set holds no weight gradients and the head computes none; each layer's
backward and gradient bytes follow its own trainable weights (`layer_backward.py`: the adapters only). A batch
of more than ``MEASURED_TOKENS`` tokens is timed at that many and scaled linearly (layer times, head time, graph and
working-set bytes beyond the weight gradients): the largest-batch search asks for batches whose head logits alone
would not fit the card.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from lightning_lazytrain.models.adapter import ModelAdapter, adapter_for
from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels

from .layer_backward import backward_ratio, streamed_bytes
from .layer_memory import rows_scaled_working_bytes, trainable_bytes
from .profile import Profile, _attention_flops, profile_model

MEASURED_TOKENS = 16384


def _freeze_as(copy_layer: torch.nn.Module, layer: torch.nn.Module) -> None:
    """Freeze each of ``copy_layer``'s parameters that is frozen in ``layer`` (a peft layer's base weight sits
    under ``base_layer``), so the copy's measured working set holds the weight gradients the run's layer has."""
    trains = {name.replace(".base_layer", ""): p.requires_grad for name, p in layer.named_parameters()}
    for name, p in copy_layer.named_parameters():
        p.requires_grad_(trains.get(name, True))


def measured_profile(
    adapter: ModelAdapter,
    batch: int,
    seq: int,
    device: torch.device,
    stream_dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | None = None,
    fused: bool = False,
    layer_bytes: list[int] | None = None,
) -> Profile:
    """Profile of ``adapter``'s model at ``batch`` x ``seq``, timed on ``device`` through a one-layer-per-kind copy;
    ``fused``: with Liger's kernels bound to that copy's layers, as the run will bind them; ``layer_bytes``: each
    layer's streamed bytes where the meta model does not hold them as the run will (a 4-bit base), else its own."""
    types = adapter.layer_types()
    kinds = list(dict.fromkeys(types))
    layers = list(adapter.layers)
    first = {kind: layers[types.index(kind)] for kind in kinds}
    config = copy.deepcopy(adapter.model.config)
    config.num_hidden_layers = len(kinds)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = kinds
    measured_batch = max(1, min(batch, MEASURED_TOKENS // seq))
    with torch.device(device):
        small = AutoModelForCausalLM.from_config(config, dtype=stream_dtype, attn_implementation="sdpa")
    copy_adapter = adapter_for(small)
    for kind, layer in zip(kinds, copy_adapter.layers):
        _freeze_as(layer, first[kind])
    copy_adapter.lm_head.requires_grad_(adapter.lm_head.weight.requires_grad)
    if fused:
        fuse_decoder_kernels(copy_adapter.layers)
    try:
        measured = profile_model(copy_adapter, measured_batch, seq, device, stream_dtype, cache_dir=cache_dir)
    finally:
        del small, copy_adapter
        torch.cuda.empty_cache()
    ratio = batch / measured_batch
    per_kind = {kind: t * ratio for kind, t in zip(kinds, measured.forward_seconds)}
    rerun = {kind: t * ratio for kind, t in zip(kinds, measured.rerun_seconds)}
    # the copy's weight gradients (none for a frozen layer) are there once at any rows; the model's own (a LoRA
    # layer's adapters, which the copy does not have) take their place
    itemsize = stream_dtype.itemsize
    own = {kind: trainable_bytes(first[kind], itemsize) for kind in kinds}
    memory = {kind: (int(g * ratio), rows_scaled_working_bytes(w, d, ratio) - d + own[kind])
              for kind, g, w, d in zip(kinds, measured.graph_bytes, measured.working_bytes, measured.gradients)}
    partial = {kind: (int(g * ratio), t * ratio)
               for kind, g, t in zip(kinds, measured.mlp_graph_bytes, measured.mlp_seconds)}
    config, tokens = adapter.model.config, batch * seq
    act = batch * seq * config.hidden_size * itemsize
    forward = [per_kind[t] for t in types]
    scaled = f", at batch {measured_batch} scaled x{ratio:.2f}" if measured_batch != batch else ""
    return replace(
        measured,
        batch=batch,
        forward_seconds=forward,
        rerun_seconds=[rerun[t] for t in types],
        backward_seconds=[backward_ratio(layer, _attention_flops(config, types[j], batch, seq), tokens) * forward[j]
                          for j, layer in enumerate(layers)],
        grad_bytes=[trainable_bytes(layer, itemsize) for layer in layers],
        head_seconds=measured.head_seconds * ratio,
        activation_bytes=[act] * (adapter.num_layers + 1),
        param_bytes=layer_bytes if layer_bytes is not None else [streamed_bytes(layer, itemsize) for layer in layers],
        layer_types=types,
        graph_bytes=[memory[t][0] for t in types],
        working_bytes=[memory[t][1] for t in types],
        mlp_graph_bytes=[partial[t][0] for t in types],
        mlp_seconds=[partial[t][1] for t in types],
        info={**measured.info, "scaling": f"measured on {measured.device_name} (one layer per kind{scaled})"},
    )
