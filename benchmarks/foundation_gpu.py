"""Issue 2 on the GPU: lazytrain vs the same model fully resident, Qwen2.5-3B shape, bf16, seq 1024, batch 8.

    python benchmarks/foundation_gpu.py --out benchmarks/results/foundation_<commit>_<machine>.json

Resident runs keep everything on the GPU (bf16 weights and fused GPU AdamW: the setting REFERENCE.md's anchors
were measured in). lazytrain runs bf16-mixed with fp32 masters and fused CPU AdamW on the host.
"""

from __future__ import annotations

import argparse
import gc
import traceback

import torch
from common import (
    BenchModule,
    RandomTokens,
    StepTimer,
    default_out,
    host_peak_gib,
    model_flops_per_token,
    print_table,
    qwen_config,
    random_model,
    run_fit,
    write_results,
)

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy


def measure(name, module, strategy, precision, data, warmup, tokens, flops_per_token, **trainer_kw):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    timer = StepTimer()
    try:
        run_fit(module, strategy, precision, data, timer, **trainer_kw)
    except Exception as exc:  # a variant that fails records why and the suite goes on
        traceback.print_exc()
        return {"variant": name, "status": f"{type(exc).__name__}: {exc}"[:400]}
    row = {"variant": name, "status": "ok", **timer.summary(warmup)}
    row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    row["host_peak_gib"] = host_peak_gib()
    row["tokens_per_s"] = tokens / row["step_s"]
    row["model_tflops"] = flops_per_token * tokens / row["step_s"] / 1e12
    row["fwd_bwd_model_tflops"] = flops_per_token * tokens / row["fwd_bwd_s"] / 1e12
    print(name, {k: v for k, v in row.items() if k != "engine"}, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/foundation_<commit>_<machine>.json")
    parser.add_argument("--shape", default="qwen2.5-3b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="run only these lazytrain variants")
    args = parser.parse_args()
    args.out = args.out or default_out("foundation")

    cfg = qwen_config(args.shape)
    data = RandomTokens(args.steps, args.batch, args.seq)
    tokens = args.batch * args.seq
    rows = []
    model = random_model(args.shape, "cuda", torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    fpt = model_flops_per_token(cfg, num_params, args.seq)
    rows.append(measure("resident", BenchModule(model), "auto", "bf16-true", data, args.warmup, tokens, fpt))
    model.gradient_checkpointing_enable()
    rows.append(measure("resident-ckpt", BenchModule(model), "auto", "bf16-true", data, args.warmup, tokens, fpt))
    model.gradient_checkpointing_disable()
    model = model.to("cpu", torch.float32)
    gc.collect()
    torch.cuda.empty_cache()
    variants = [  # name, optimizer, strategy kwargs, gradient_clip_val
        ("lazytrain-null", "null", {}, None),
        ("lazytrain-null-graph12", "null", {"keep_graph_layers": 12}, None),
        ("lazytrain-adamw", "adamw", {}, None),
        ("lazytrain-hybrid0-clip", "hybrid0", {}, 1.0),
        ("lazytrain-hybrid0-clip-graph12", "hybrid0", {"keep_graph_layers": 12}, 1.0),
        ("lazytrain-hybrid1-clip", "hybrid1", {}, 1.0),
        ("lazytrain-interval4-adamw", "adamw", {"schedule": "interval:4", "overlap_updates": False}, 1.0),
    ]
    for name, opt, skw, clip in variants:
        if args.only and name not in args.only:
            continue
        rows.append(measure(name, BenchModule(model, opt), LazyTrainStrategy(**skw), "bf16-mixed", data,
                            args.warmup, tokens, fpt, gradient_clip_val=clip))
        model.zero_grad(set_to_none=True)
        gc.collect()
    ok = {r["variant"]: r for r in rows if r["status"] == "ok"}
    checks = {}
    if "resident" in ok:
        for name, r in ok.items():
            if name.startswith("lazytrain"):
                checks[name] = {
                    "step_vs_resident": r["step_s"] / ok["resident"]["step_s"],
                    "fwd_bwd_vs_resident": r["fwd_bwd_s"] / ok["resident"]["fwd_bwd_s"],
                    "fwd_bwd_vs_resident_ckpt": r["fwd_bwd_s"] / ok["resident-ckpt"]["fwd_bwd_s"]
                    if "resident-ckpt" in ok else None,
                    "gpu_peak_vs_resident": r["gpu_peak_gib"] / ok["resident"]["gpu_peak_gib"],
                    "optimizer_share_of_step": r["optimizer_s"] / r["step_s"],
                }
    write_results(args.out, {"shape": args.shape, "batch": args.batch, "seq": args.seq, "num_params": num_params,
                             "runs": rows, "checks": checks})
    print_table(rows, [("step_s", "step s", ".3f"), ("fwd_bwd_s", "fwd+bwd s", ".3f"),
                       ("optimizer_s", "opt s", ".3f"), ("gpu_peak_gib", "GPU GiB", ".1f"),
                       ("model_tflops", "TFLOPS", ".1f")], width=32)
    for name, c in checks.items():
        print(name, {k: round(v, 3) if v is not None else None for k, v in c.items()})


if __name__ == "__main__":
    main()
