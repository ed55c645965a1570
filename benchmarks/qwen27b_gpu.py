"""Issue 39: the paper's primary run on one H200 with a 128 GiB host: random-init Qwen3.6-27B, seq 1024, bf16-true,
HybridAdamW with 8-bit states, clip 1.0, the MILP plan and the planned gradient home, at batch 72; then larger
batches until one does not fit (or the time budget is spent).

    python benchmarks/qwen27b_gpu.py --out benchmarks/results/qwen27b_<commit>_<machine>.json

Each row: step time over the timed steps (CUDA events, ``common.StepTimer``), model-TFLOPS and tokens/s, the GPU
peak (``max_memory_allocated``), the host peak sampled through the run (``lightning_lazytrain.host_peak``: RSS,
pinned and pageable alike, by phase) and what ``lazytrain plan`` predicts for the same batch on this host (step,
host need, gradient home). GPU only; about 10 minutes on an H200 (the model is built once, ~51 GB on the host).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time

import lightning.pytorch as pl
import psutil
import torch
from common import (
    BenchModule,
    RandomTokens,
    StepTimer,
    default_out,
    model_flops_per_token,
    write_results,
)
from plan_query import plan_asked
from transformers import AutoModelForCausalLM

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.host_peak import HostPeakMemory
from lightning_lazytrain.sft.plan_model import model_config

SHAPE, SEQ, GIB = "qwen3.6-27b", 1024, 2**30


def predicted(batch: int) -> dict:
    """``lazytrain plan`` for ``batch`` on an H200 with this host's available RAM (analytic times, no search)."""
    asked = plan_asked(SHAPE, SHAPE, batch, timeout_s=120)
    if "error" in asked:
        return asked
    return {
        "fits": asked["fits"],
        "step_s": (asked["prediction"] or {}).get("step_s"),
        "model_tflops": asked["model_tflops"],
        "gradient_home": asked["gradient_home"],
        "host_need_gib": asked["tiers"]["host"]["need_bytes"] / GIB,
        "host_fits": asked["tiers"]["host"]["need_bytes"] <= asked["tiers"]["host"]["have_bytes"],
        "gpu_fits": asked["fits_gpu"],
        "gpu_need_gib": asked["tiers"]["gpu"]["need_bytes"] / GIB,
    }


def heartbeat(every_s: float = 15.0) -> None:
    """Print the process's RSS and the host's available RAM every ``every_s`` from a daemon thread: the last call
    on an H100 host ended without a word after setup, and a kernel OOM kill leaves only this trail."""
    start = time.perf_counter()

    def beat() -> None:
        while True:
            rss, free = psutil.Process().memory_info().rss, psutil.virtual_memory().available
            print(f"[{time.perf_counter() - start:6.0f} s] rss {rss / GIB:.1f} GiB, available {free / GIB:.1f} GiB",
                  file=sys.stderr, flush=True)
            time.sleep(every_s)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def measure(model, batch: int, steps: int, warmup: int, fpt: float) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    sampler, timer = HostPeakMemory(), StepTimer()
    row = {"batch": batch, "seq": SEQ, "plan": predicted(batch)}
    try:
        data = RandomTokens(steps, batch, SEQ, vocab=model.config.vocab_size)
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            strategy=LazyTrainStrategy(schedule="milp"),
            precision="bf16-true",
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[timer, sampler],
            num_sanity_val_steps=0,
            gradient_clip_val=1.0,
        )
        trainer.fit(BenchModule(model, "hybrid1"), torch.utils.data.DataLoader(data, batch_size=None))
    except Exception as exc:  # the batch that does not fit ends the search; the row says why
        sampler.close()
        return {**row, "status": f"{type(exc).__name__}: {exc}"[:400], "host_peak_gib": sampler.peak_bytes / GIB}
    sampler.close()
    row.update(status="ok", **timer.summary(warmup))
    tokens = batch * SEQ
    row["tokens_per_s"] = tokens / row["step_s"]
    row["model_tflops"] = fpt * tokens / row["step_s"] / 1e12
    row["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    row["host_peak_gib"] = sampler.peak_bytes / GIB
    row["host_peaks_gib"] = {k: v / GIB for k, v in sampler.peaks.items()}
    print({k: v for k, v in row.items() if k != "engine"}, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="default: benchmarks/results/qwen27b_<commit>_<machine>.json")
    parser.add_argument("--batch", type=int, default=72)
    parser.add_argument("--steps", type=int, default=7, help="steps at --batch (the first --warmup untimed)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--larger", type=int, nargs="*", default=[96, 128], help="larger batches to try, 3 steps each")
    parser.add_argument("--budget-s", type=float, default=360.0, help="no larger batch is started after this")
    args = parser.parse_args()
    args.out = args.out or default_out("qwen27b")
    start = time.perf_counter()
    heartbeat()
    config, source = model_config(None, SHAPE, False)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU is minutes faster than on the host; handed over in host RAM
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to("cpu")
    torch.cuda.empty_cache()
    num_params = sum(p.numel() for p in model.parameters())
    fpt = model_flops_per_token(config, num_params, SEQ)
    built_s = time.perf_counter() - start
    def save(rows: list[dict]) -> None:  # after every row: a run the call's time limit stops keeps its rows
        fitting = [r["batch"] for r in rows if r["status"] == "ok"]
        write_results(
            args.out,
            {
                "group": "qwen27b",
                "shape": SHAPE,
                "config": source,
                "params": num_params,
                "precision": "bf16-true",
                "optimizer": "HybridAdamW eight_bit_fraction=1.0",
                "model_build_s": built_s,
                "host_total_gib": psutil.virtual_memory().total / GIB,
                "largest_batch_measured": max(fitting, default=None),
                "rows": rows,
                "wall_s": time.perf_counter() - start,
                "pid": os.getpid(),
            },
        )

    rows = [measure(model, args.batch, args.steps, args.warmup, fpt)]
    save(rows)
    for batch in args.larger:
        if rows[-1]["status"] != "ok" or time.perf_counter() - start > args.budget_s:
            break
        rows.append(measure(model, batch, 3, 1, fpt))
        save(rows)
        gc.collect()


if __name__ == "__main__":
    main()
