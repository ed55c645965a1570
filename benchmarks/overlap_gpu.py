"""Issue 4 end to end: the same plan with the optimizer update overlapped (engine-run, per layer, behind the next
forward) vs after the backward (``overlap_updates=False``: fp32 host gradients, ``optimizer.step()``).

    python benchmarks/overlap_gpu.py --out benchmarks/results/overlap_<commit>_<machine>.json

Qwen2.5-7B shape, bf16-mixed, HybridAdamW with all 8-bit states, clip 1.0, under an 80 GiB GPU cap.
"""

from __future__ import annotations

import argparse
import gc

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
    parser.add_argument("--out", default=None, help="default: benchmarks/results/overlap_<commit>_<machine>.json")
    parser.add_argument("--cap-gib", type=float, default=80.0)
    parser.add_argument("--batches", type=int, nargs="*", default=[8, 32])
    args = parser.parse_args()
    args.out = args.out or default_out("overlap")
    cap_gpu_memory(args.cap_gib)
    seq, rows = 1024, []
    model = host_model("qwen2.5-7b")
    fpt = model_flops_per_token(qwen_config("qwen2.5-7b"), sum(p.numel() for p in model.parameters()), seq)
    for batch in args.batches:
        graphs = 8 if batch <= 16 else 4
        for overlap in (True, False):
            name = f"7b-bs{batch}-{'overlapped' if overlap else 'after-backward'}"
            strategy = LazyTrainStrategy(keep_graph_layers=graphs, overlap_updates=overlap)
            row = measure(name, BenchModule(model, "hybrid1"), strategy, "bf16-mixed", RandomTokens(4, batch, seq), 1,
                          batch * seq, fpt, gradient_clip_val=1.0)
            rows.append({**row, "model": "qwen2.5-7b", "batch": batch, "overlap": overlap})
            model.zero_grad(set_to_none=True)
            gc.collect()
    write_results(args.out, {"seq": seq, "gpu_cap_gib": args.cap_gib, "runs": rows})
    print_table(rows, [("step_s", "step s", ".2f"), ("fwd_bwd_s", "fwd+bwd", ".2f"), ("optimizer_s", "opt s", ".2f"),
                       ("gpu_peak_gib", "GPU GiB", ".1f"), ("model_tflops", "TFLOPS", ".1f")], width=32)


if __name__ == "__main__":
    main()
