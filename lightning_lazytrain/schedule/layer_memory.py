"""A layer's GPU memory beyond its input boundary: what its kept graph holds and its forward+backward peak.

On CUDA both are measured on one copy of the layer (``max_memory_allocated`` / ``memory_allocated`` deltas from
just before its forward-with-grad, through its backward). Without CUDA they are estimated from the config: per
token, the tensors autograd saves in a decoder layer (the two RMSNorms' fp32 inputs and normalized outputs, Q/K/V
and the attention output, the MLP's gate/up/activation/product), and for the peak the backward's transient
intermediates, the input gradient and the weight gradients. The graph of a layer whose MLP re-runs in the backward
(``engine/compute/mlp_recompute.py``) is measured the same way under ``checkpointed_mlp``, and estimated as the graph
without the MLP's intermediates (the MLP's input stays: it is the second norm's output).
``saved_tensor_bytes`` counts what autograd really saves (saved-tensor hooks),
the reference the estimate is tested against. The analytic estimates also give the two times the MILP weighs with
these bytes: an MLP's forward and the output projection a layer's re-run skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.compute.gradient_only_linear import skips_mlp_output
from lightning_lazytrain.engine.compute.mlp_recompute import checkpointed_mlp
from lightning_lazytrain.models.adapter import ModelAdapter
from lightning_lazytrain.models.fused_kernels import UNFUSED, FusedParts, fusable


def unique_numel(module: torch.nn.Module) -> int:
    """Parameters of ``module``, a tied one counted once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def trainable_bytes(module: torch.nn.Module, itemsize: int) -> int:
    """Bytes of ``module``'s weight gradients in a dtype of ``itemsize``: its trainable parameters, a tied one once
    (none for a frozen layer)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad) * itemsize


def rows_scaled_working_bytes(working_bytes: int, grad_bytes: int, scale: float) -> int:
    """A layer's working set measured on some rows, carried to ``scale`` times as many: the weight gradients
    (``grad_bytes``) are there once at any rows, the rest (intermediates, input gradients, the re-run's graph)
    grows with the rows."""
    return round(max(0, working_bytes - grad_bytes) * scale) + grad_bytes


def _mlp_width(config) -> int:
    """Intermediate features per token: dense MLP, or the routed experts' (top-k) plus a shared expert."""
    experts = getattr(config, "num_experts_per_tok", None)
    moe = getattr(config, "moe_intermediate_size", None)
    if experts and moe:
        return int(experts * moe + (getattr(config, "shared_expert_intermediate_size", 0) or 0))
    return int(config.intermediate_size)


def _mixer_width(config, layer_type: str) -> int:
    """Features per token the token mixer saves: Q, K, V, the attention output and rotated Q/K."""
    if layer_type == "linear_attention":
        k = getattr(config, "linear_num_key_heads", 0) * getattr(config, "linear_key_head_dim", 0)
        v = getattr(config, "linear_num_value_heads", 0) * getattr(config, "linear_value_head_dim", 0)
        return 14 * (2 * k + 2 * v)  # projections, conv, gates and the chunked state's per-token terms
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = getattr(config, "num_key_value_heads", config.num_attention_heads) * head_dim
    width = 3 * q + 4 * kv + q  # q/k/v, rotated q/k (+ repeated kv), attention output; the gate of gated attention
    if str(getattr(config, "model_type", "")).startswith("qwen3"):
        width += 3 * (q + kv)  # per-head RMSNorm of q and k: fp32 input and normalized copies
    return width


def _mlp_per_token(config, itemsize: int) -> int:
    """Bytes per token the MLP's own autograd graph saves: gate, up, activation, product (+ the MoE routing)."""
    hidden, mlp = config.hidden_size, _mlp_width(config)
    per_token = itemsize * 4 * mlp
    experts = getattr(config, "num_experts_per_tok", None) if getattr(config, "moe_intermediate_size", None) else None
    if experts:  # routed copies of each token's input and output, fp32 router probabilities
        per_token += itemsize * 2 * experts * hidden + 4 * 2 * getattr(config, "num_experts", 0)
    return per_token


def analytic_layer_memory(config, layer_type: str, tokens: int, itemsize: int, grad_bytes: int,
                          fused: FusedParts = UNFUSED) -> tuple[int, int]:
    """(graph bytes, peak working bytes) of one layer's forward+backward for ``tokens`` tokens, estimated;
    ``grad_bytes``: its weight gradients (``trainable_bytes``: all its weights, or a LoRA layer's adapters).

    ``fused`` says which parts run Liger's kernels (``models/fused_kernels.py``): its SwiGLU keeps gate and up but
    not the activation (the product stays: it is the down projection's input), and its backward writes one
    intermediate-sized gradient buffer fewer. Its RoPE keeps what HF's keeps (measured the same, same file).
    """
    hidden, mlp = config.hidden_size, _mlp_width(config)
    graph = analytic_mlp_recompute_graph(config, layer_type, tokens, itemsize, fused_norms=fused.norms)
    graph += tokens * (_mlp_per_token(config, itemsize) - (itemsize * mlp if fused.mlp else 0))
    gradients = (1 if fused.mlp else 2) * mlp + 2 * hidden  # gate/up gradients, input gradient, output
    return graph, graph + tokens * itemsize * gradients + grad_bytes


def analytic_mlp_recompute_graph(config, layer_type: str, tokens: int, itemsize: int, fused_norms: bool = False) -> int:
    """Graph bytes of one layer whose MLP re-runs in the backward: norms, the token mixer, the hidden states."""
    hidden = config.hidden_size
    if layer_type == "linear_attention":  # not measured on a GPU: the earlier count, three fp32 copies per norm
        norms = 2 * 3 * 4 * hidden + itemsize * 3 * hidden
    elif fused_norms:
        # Liger's norm keeps its input and one fp32 value a row: against HF's, no fp32 copies and one hidden-sized
        # tensor fewer; one layer measured on an H200 (benchmarks/results/layer_kernels_c17ab17_h200.json) has 73,728
        # bytes a token less (7B shape), which is 10 bytes a hidden feature and the activation's intermediate
        norms = 3 * itemsize * hidden
    else:
        # each RMSNorm keeps its input cast to fp32 and its normalized output in the stream dtype (the projections'
        # input, the MLP's too); two more hidden-sized tensors: the attention block's output and the layer's.
        # Against one layer measured on an H100 in bf16 (benchmarks/results/layer_memory_577e8ff_h100.json) the whole
        # graph comes to 1.04x (3B, 7B) to 1.06x (14B) of the measurement, this one to 1.11x.
        norms = 2 * (4 + itemsize) * hidden + itemsize * 2 * hidden
    return tokens * (norms + itemsize * _mixer_width(config, layer_type))


@dataclass(frozen=True)
class LayerEstimates:
    """Per layer, the `Profile` fields of the same names, estimated from the config (no GPU)."""

    graph_bytes: list[int]
    working_bytes: list[int]
    mlp_graph_bytes: list[int]
    mlp_seconds: list[float]


def analytic_layer_estimates(adapter: ModelAdapter, tokens: int, itemsize: int, flops_per_s: float,
                             fused: bool = False) -> LayerEstimates:
    """Graph, working-set and MLP-re-run bytes of every layer for ``tokens`` tokens, and one MLP forward's seconds
    at ``flops_per_s``: the MLP's share of the layer's FLOPs is its share of the weights (the attention's mixing
    aside). ``fused``: the run binds Liger's kernels where a layer allows (``fusable``)."""
    config, types = adapter.model.config, adapter.layer_types()
    layers = list(adapter.layers)
    parts = [fusable(layer) if fused else UNFUSED for layer in layers]
    memory = [analytic_layer_memory(config, types[j], tokens, itemsize, trainable_bytes(layer, itemsize), parts[j])
              for j, layer in enumerate(layers)]
    return LayerEstimates(
        graph_bytes=[graph for graph, _ in memory],
        working_bytes=[work for _, work in memory],
        mlp_graph_bytes=[analytic_mlp_recompute_graph(config, t, tokens, itemsize, fused_norms=parts[j].norms)
                         for j, t in enumerate(types)],
        mlp_seconds=[2.0 * unique_numel(layer.mlp) * tokens / flops_per_s for layer in layers],
    )


def micro_batch_working_bytes(working_bytes: int, grad_bytes: int, boundary_bytes: int, micro_batches: int) -> int:
    """A layer's working set when it runs in ``micro_batches`` row slices (`engine/compute/micro_batches.py`): what
    scales with the tokens (graph of the re-run, intermediates, input gradients) divides; the weight gradients
    (``grad_bytes``, the trainable weights' in the stream dtype) do not, and from two slices on their running sum
    is a second set; and one whole boundary more, the batch's input gradient (or a kept graph's output) that the
    slices' are written into."""
    if micro_batches <= 1:
        return working_bytes
    per_token = max(0, working_bytes - grad_bytes)
    return -(-per_token // micro_batches) + 2 * grad_bytes + boundary_bytes


def output_projection_seconds(adapter: ModelAdapter, tokens: int, flops_per_s: float) -> list[float]:
    """Per layer, the seconds of its MLP's output projection over ``tokens`` at ``flops_per_s``, which its re-run in
    the backward skips (0 where the layer runs it in full: ``skips_mlp_output``)."""
    return [2.0 * layer.mlp.down_proj.weight.numel() * tokens / flops_per_s if skips_mlp_output(layer) else 0.0
            for layer in adapter.layers]


def measure_layer_memory(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> tuple[int, int]:
    """(graph bytes, peak working bytes) of ``layer``'s forward-with-grad then backward on CUDA."""
    device = hidden.device
    x = hidden.detach().requires_grad_()
    params = [p for p in layer.parameters() if p.requires_grad]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.enable_grad():
        out = layer(x, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
    graph = torch.cuda.memory_allocated(device) - base
    grads = torch.autograd.grad(out, [x, *params], torch.ones_like(out))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del grads, out
    return int(graph), int(peak)


def measure_mlp_recompute_graph(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> int:
    """Graph bytes of ``layer``'s forward-with-grad with its MLP under the backward's re-run, on CUDA."""
    device = hidden.device
    x = hidden.detach().requires_grad_()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    with torch.enable_grad(), checkpointed_mlp(layer):
        out = layer(x, **kwargs)
    graph = torch.cuda.memory_allocated(device) - base
    del out
    return int(graph)


def saved_tensor_bytes(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict) -> int:
    """Bytes of the distinct storages autograd saves in ``layer``'s forward, leaving out the input and the weights."""
    skip = {hidden.untyped_storage().data_ptr()} | {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    x = hidden.detach().requires_grad_()
    skip.add(x.untyped_storage().data_ptr())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, **kwargs)
    return sum(seen.values())
