"""One decoder layer with HF's own kernels against Liger's fused RMSNorm, SwiGLU and RoPE: time, memory, agreement.

    python benchmarks/layer_kernels_gpu.py --out benchmarks/results/layer_kernels_h100.json

Per batch (Qwen2.5-7B shape, seq 1024, bf16, sdpa, no mask): the forward with grad, its backward, the forward
without grad (what rebuilding a boundary costs), the kept graph and the peak, each variant on the same layer and
input, medians of CUDA-event timings. The backward's re-run skips the MLP's output projection
(`engine/compute/gradient_only_linear.py`): timed without grad, and as the re-run with grad plus its backward (what a
layer without a kept graph costs in the backward), with its gradients' largest difference to the plain layer's.
Agreement is the largest difference of the output and of every gradient to the HF layer's, relative to that
tensor's largest magnitude. A profile of one forward+backward per variant splits the kernel time into matrix
multiplies, attention and the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from common import median_seconds, print_table, qwen_config, write_results
from transformers import AutoModelForCausalLM

from lightning_lazytrain.engine.compute.gradient_only_linear import mlp_output_skipped
from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.models.fused_kernels import fuse_decoder_kernels, unfuse_decoder_kernels
from lightning_lazytrain.schedule.timing import rotary_inputs

GIB = 2**30


@contextlib.contextmanager
def _variant(name: str, layer: torch.nn.Module):
    if name == "liger":
        fuse_decoder_kernels([layer])
    try:
        yield
    finally:
        unfuse_decoder_kernels([layer])


def _kernel_split(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    split = {"gemm_ms": 0.0, "attention_ms": 0.0, "other_ms": 0.0}
    others = []
    for evt in prof.key_averages():
        ms = evt.device_time_total / 1e3 if hasattr(evt, "device_time_total") else evt.cuda_time_total / 1e3
        if ms <= 0:
            continue
        name = evt.key.lower()
        # attention first: cuDNN's attention kernels carry "sm90" and "xmma" in their names too
        if any(k in name for k in ("flash", "fmha", "attention", "attn", "cudnn", "sdpa")):
            split["attention_ms"] += ms
        elif any(k in name for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "ampere_bf16", "sm90")):
            split["gemm_ms"] += ms
        else:
            split["other_ms"] += ms
            others.append((ms, evt.key[:90]))
    split["top_other"] = [f"{ms:.2f} ms {k}" for ms, k in sorted(others, reverse=True)[:8]]
    return split


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def _measure(layer: torch.nn.Module, h: torch.Tensor, kwargs: dict, g: torch.Tensor, reps: int, profile: bool):
    params = list(layer.parameters())
    x = h.detach().requires_grad_()

    def run_layer():
        out = layer(x, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def fwd_bwd():
        return torch.autograd.grad(run_layer(), [x, *params], g)

    def nograd():
        with torch.no_grad():
            run_layer()

    def skipped_fwd_bwd():
        with mlp_output_skipped(layer):
            return fwd_bwd()

    def skipped_nograd():
        with mlp_output_skipped(layer):
            nograd()

    for _ in range(2):
        fwd_bwd()
        nograd()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run_layer()
    graph = torch.cuda.memory_allocated() - base
    grads = torch.autograd.grad(out, [x, *params], g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    result = [out.detach(), *grads]
    skipped = skipped_fwd_bwd()
    skip_diff = max(_rel_diff(a, b) for a, b in zip(skipped, grads, strict=True))
    del out, grads, skipped
    stats = {"fwd_bwd_ms": median_seconds(fwd_bwd, reps) * 1e3, "fwd_nograd_ms": median_seconds(nograd, reps) * 1e3,
             "rerun_bwd_ms": median_seconds(skipped_fwd_bwd, reps) * 1e3,
             "rerun_nograd_ms": median_seconds(skipped_nograd, reps) * 1e3, "rerun_grad_rel_diff": skip_diff,
             "graph_gib": graph / GIB, "peak_gib": peak / GIB, **(_kernel_split(fwd_bwd) if profile else {})}
    return result, stats


def _rows(batch: int, seq: int, reps: int, variants: list[str], profile_batch: int) -> list[dict]:
    config = copy.deepcopy(qwen_config("qwen2.5-7b"))
    config.num_hidden_layers = 1
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    adapter = adapter_for(model)
    layer = adapter.layers[0]
    with torch.no_grad():  # a trained layer's weights are not all near their init: make the norms matter
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    h = torch.randn(batch, seq, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    pos, pe = rotary_inputs(adapter.rotary, h, batch, seq)
    kwargs = {"attention_mask": None, "position_ids": pos, "position_embeddings": pe}
    g = torch.randn_like(h)
    reference = None
    rows = []
    for name in variants:
        with _variant(name, layer):
            result, stats = _measure(layer, h, kwargs, g, reps, batch == profile_batch)
        reference = result if reference is None else reference
        worst = max(_rel_diff(a, b) for a, b in zip(result, reference, strict=True))
        rows.append({"variant": f"b{batch} {name}", "kernels": name, "batch": batch, "seq": seq, **stats,
                     "max_rel_diff_vs_hf": worst, "status": "ok"})
    del model, adapter, layer, h, reference, result
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", nargs="+", type=int, default=[16, 64, 144])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["hf", "liger"])
    parser.add_argument("--profile-batch", type=int, default=64)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = [r for b in args.batches for r in _rows(b, args.seq, args.reps, args.variants, args.profile_batch)]
    write_results(args.out, {"rows": rows})
    for r in rows:
        for line in r.get("top_other", []):
            print(r["variant"], line)
        for key in ("gemm_ms", "attention_ms", "other_ms"):
            r.setdefault(key, float("nan"))  # profiled at one batch only
    print_table(rows, [("fwd_bwd_ms", "fwd+bwd ms", ".1f"), ("fwd_nograd_ms", "fwd ms", ".1f"),
                       ("rerun_nograd_ms", "re-run ms", ".1f"), ("rerun_bwd_ms", "re-run+bwd ms", ".1f"),
                       ("rerun_grad_rel_diff", "re-run diff", ".1e"),
                       ("graph_gib", "graph", ".2f"), ("peak_gib", "peak", ".2f"),
                       ("max_rel_diff_vs_hf", "rel diff", ".1e"), ("gemm_ms", "gemm", ".1f"),
                       ("attention_ms", "attn", ".1f"), ("other_ms", "other", ".1f")], width=18)


if __name__ == "__main__":
    main()
