"""`profile_model` for a model that has no weights (built on the meta device), measured on this CUDA device.

A copy of the model with one decoder layer per layer kind is built on the device with random weights (the
embeddings and head included), profiled as usual, and its per-kind layer times are spread over the full model's
layers; bytes come from the full model's shapes. A batch of more than ``MEASURED_TOKENS`` tokens is timed at that
many and scaled linearly (layer times, head time, graph and working-set bytes beyond the weight gradients): the
largest-batch search asks for batches whose head logits alone would not fit the card.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
from transformers import AutoModelForCausalLM

from lightning_lazytrain.models.adapter import ModelAdapter, adapter_for
from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels

from .layer_memory import rows_scaled_working_bytes, unique_numel
from .profile import Profile, profile_model

MEASURED_TOKENS = 16384


def measured_profile(
    adapter: ModelAdapter,
    batch: int,
    seq: int,
    device: torch.device,
    stream_dtype: torch.dtype = torch.bfloat16,
    cache_dir: str | None = None,
    fused: bool = False,
) -> Profile:
    """Profile of ``adapter``'s model at ``batch`` x ``seq``, timed on ``device`` through a one-layer-per-kind copy;
    ``fused``: with Liger's kernels bound to that copy's layers, as the run will bind them."""
    types = adapter.layer_types()
    kinds = list(dict.fromkeys(types))
    config = copy.deepcopy(adapter.model.config)
    config.num_hidden_layers = len(kinds)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = kinds
    measured_batch = max(1, min(batch, MEASURED_TOKENS // seq))
    with torch.device(device):
        small = AutoModelForCausalLM.from_config(config, dtype=stream_dtype, attn_implementation="sdpa")
    copy_adapter = adapter_for(small)
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
    # the copy is built trainable: its weight gradients are its parameter bytes
    memory = {kind: (int(g * ratio), rows_scaled_working_bytes(w, p, ratio))
              for kind, g, w, p in zip(kinds, measured.graph_bytes, measured.working_bytes, measured.param_bytes)}
    partial = {kind: (int(g * ratio), t * ratio)
               for kind, g, t in zip(kinds, measured.mlp_graph_bytes, measured.mlp_seconds)}
    itemsize = stream_dtype.itemsize
    act = batch * seq * adapter.model.config.hidden_size * itemsize
    scaled = f", at batch {measured_batch} scaled x{ratio:.2f}" if measured_batch != batch else ""
    return replace(
        measured,
        batch=batch,
        forward_seconds=[per_kind[t] for t in types],
        rerun_seconds=[rerun[t] for t in types],
        head_seconds=measured.head_seconds * ratio,
        activation_bytes=[act] * (adapter.num_layers + 1),
        param_bytes=[unique_numel(layer) * itemsize for layer in adapter.layers],
        layer_types=types,
        graph_bytes=[memory[t][0] for t in types],
        working_bytes=[memory[t][1] for t in types],
        mlp_graph_bytes=[partial[t][0] for t in types],
        mlp_seconds=[partial[t][1] for t in types],
        info={**measured.info, "scaling": f"measured on {measured.device_name} (one layer per kind{scaled})"},
    )
