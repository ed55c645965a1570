"""Larger shapes on the H200: Qwen2.5-7B under an 80 GiB GPU cap at several batches, and a 14B bf16-true run.

    python benchmarks/scale_gpu.py --out benchmarks/results/scale_<commit>_<machine>.json

7B runs bf16-mixed with HybridAdamW (all 8-bit states: fp32 states would not leave room in 125 GiB of host RAM
next to fp32 masters), clip 1.0; the MegaTrain-like baseline is interval:4 with the update after the backward.
The 14B run is bf16-true masters + 8-bit states (~6 bytes per parameter on the host).
"""

from __future__ import annotations

import argparse
import gc

import torch
from common import (
    BenchModule,
    RandomTokens,
    cap_gpu_memory,
    default_out,
    host_model,
    model_flops_per_token,
    print_table,
    qwen_config,
    write_results,
)
from foundation_gpu import measure

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/scale_<commit>_<machine>.json")
    parser.add_argument("--cap-gib", type=float, default=80.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-14b", action="store_true")
    args = parser.parse_args()
    args.out = args.out or default_out("scale")
    cap_gpu_memory(args.cap_gib)
    seq, rows = 1024, []
    model = host_model("qwen2.5-7b")
    cfg = qwen_config("qwen2.5-7b")
    num_params = sum(p.numel() for p in model.parameters())
    fpt = model_flops_per_token(cfg, num_params, seq)
    variants = [  # batch, name, optimizer, strategy kwargs
        (16, "lazytrain-graph8", "hybrid1", {"keep_graph_layers": 8}),
        (32, "lazytrain-graph4", "hybrid1", {"keep_graph_layers": 4}),
        (32, "lazytrain-milp", "hybrid1", {"schedule": "milp", "gpu_activation_gib": 20.0, "cpu_activation_gib": 16.0}),
        (32, "lazytrain-interval4-after-backward", "hybrid1", {"schedule": "interval:4", "overlap_updates": False}),
    ]
    for batch, name, opt, skw in variants:
        data = RandomTokens(args.steps, batch, seq)
        row = measure(f"7b-bs{batch}-{name}", BenchModule(model, opt), LazyTrainStrategy(**skw), "bf16-mixed", data,
                      args.warmup, batch * seq, fpt, gradient_clip_val=1.0)
        rows.append({**row, "model": "qwen2.5-7b", "batch": batch, "gpu_cap_gib": args.cap_gib})
        model.zero_grad(set_to_none=True)
        gc.collect()
    del model
    gc.collect()
    if not args.skip_14b:
        cap_gpu_memory(1e9)
        model = host_model("qwen2.5-14b", torch.bfloat16)
        cfg = qwen_config("qwen2.5-14b")
        n14 = sum(p.numel() for p in model.parameters())
        data = RandomTokens(4, 8, seq)
        row = measure("14b-bs8-bf16true-8bit", BenchModule(model, "hybrid1"), LazyTrainStrategy(keep_graph_layers=8),
                      "bf16-true", data, 1, 8 * seq, model_flops_per_token(cfg, n14, seq), gradient_clip_val=1.0)
        rows.append({**row, "model": "qwen2.5-14b", "batch": 8, "num_params": n14})
    write_results(args.out, {"seq": seq, "runs": rows})
    print_table(rows, [("step_s", "step s", ".2f"), ("fwd_bwd_s", "fwd+bwd", ".2f"), ("gpu_peak_gib", "GPU GiB", ".1f"),
                       ("host_rss_max_gib", "host GiB", ".1f"), ("model_tflops", "TFLOPS", ".1f")], width=48)


if __name__ == "__main__":
    main()
