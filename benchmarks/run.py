"""The benchmark suite: lazytrain against what a user would pick instead, through one Lightning ``Trainer`` and one
LightningModule, random-init Qwen2.5 shapes, seq 1024, bf16, under emulated GPU memory caps.

    python benchmarks/run.py --models qwen2.5-3b --systems all --batches 8   # -> results/run_<commit>_<machine>.json
    python benchmarks/run.py --models qwen2.5-7b --systems lazytrain --caps 80 24 --batches max

``--batches max`` searches the largest batch under the cap: candidates from the largest down; a candidate that
admission control or the plan refuses before step 1 (or that runs out of memory in it) is recorded and the next
smaller one is run. ``--merge FILE`` keeps the runs of an earlier call (same system, model, batch, cap: replaced).
Each finished run is written at once, so a call cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback

import torch
from common import (
    GPU,
    RandomTokens,
    StepTimer,
    cap_gpu_memory,
    commit,
    default_out,
    machine,
    model_flops_per_token,
    qwen_config,
    run_fit,
)
from probe import HostPeakSampler, trainer_facts
from systems import SYSTEMS, build, gpu_update_share, rerun_share, work_ratio

import lightning_lazytrain  # noqa: F401

SEQ = 1024
MAX_CANDIDATES = {80.0: (64, 48, 32, 24, 16, 8), 24.0: (32, 24, 16, 12, 8, 4)}
FIT_FAILURES = ("OutOfMemory", "out of memory", "AdmissionError", "InfeasibleSchedule", "DeviceTooSmall")


def _num_params(shape: str) -> int:
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(qwen_config(shape))
    return sum(p.numel() for p in model.parameters())


def _fit(system: str, shape: str, batch: int, steps: int, timer: StepTimer, host_cache: dict, fp32_adamw: bool,
         gpu_share: float | None = None):
    run = build(system, shape, batch, host_cache, fp32_adamw=fp32_adamw, gpu_share=gpu_share)
    try:
        data = RandomTokens(steps, batch, SEQ, qwen_config(shape).vocab_size)
        run_fit(run.module, run.strategy, run.precision, data, timer, **run.trainer_kw)
    finally:
        gc.collect()
    return run


def _failed(row: dict, exc: Exception) -> dict:
    """A run that cannot fit or fails records why, and the suite goes on."""
    traceback.print_exc(limit=4)
    gc.collect()
    torch.cuda.empty_cache()
    row["status"] = f"{type(exc).__name__}: {exc}"[:600]
    return row


def allocator_facts() -> dict:
    """The caching allocator's peak reservation and how often it had to free its cache and retry (each retry
    synchronizes the device, which undoes any overlap)."""
    stats = torch.cuda.memory_stats()
    return {"gpu_reserved_peak_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
            "alloc_retries": stats.get("num_alloc_retries", 0)}


def one_run(system: str, shape: str, batch: int, cap: float | None, steps: int, warmup: int,
            host_cache: dict, gpu_share: float | None = None) -> dict:
    """``steps`` batches, the first ``warmup`` untimed: ``steps - warmup - 1`` intervals from batch start to batch
    start are timed. ``gpu_share``: the GPU's share of the update for the ``-ratio`` systems."""
    row = {"system": system, "model": shape, "batch": batch, "seq": SEQ, "gpu_cap_gib": cap, "commit": commit(),
           "command": " ".join(["python", *sys.argv])}
    gc.collect()
    torch.cuda.empty_cache()
    cap_gpu_memory(cap if cap is not None else 1e9)
    if GPU:
        torch.cuda.reset_peak_memory_stats()
    timer = StepTimer(gpu_update_share)
    sampler = HostPeakSampler()
    with sampler:
        try:
            run = _fit(system, shape, batch, steps, timer, host_cache, fp32_adamw=True, gpu_share=gpu_share)
        except Exception as exc:
            if system == "lazytrain-interval4" and type(exc).__name__ == "AdmissionError":
                # the MegaTrain policy with fp32 states does not fit this host: 8-bit states
                timer = StepTimer(gpu_update_share)
                try:
                    run = _fit(system, shape, batch, steps, timer, host_cache, fp32_adamw=False)
                except Exception as exc2:
                    return _failed(row, exc2)
            else:
                return _failed(row, exc)
    s = timer.summary(warmup)
    engine = s["engine"]
    tokens = batch * SEQ
    fpt = model_flops_per_token(qwen_config(shape), _num_params(shape), SEQ)
    ratio = work_ratio(system, timer.plan, rerun_share(qwen_config(shape), SEQ))
    stall = engine.get("stall_s", 0.0)
    waits = engine.get("update_wait_s", 0.0)
    schedule = getattr(run.strategy, "schedule_result", None)
    row.update({
        "status": "ok", "optimizer": run.optimizer, "note": run.note, "step_s": s["step_s"],
        "step_s_each": s["step_s_each"],
        "tokens_per_s": tokens / s["step_s"], "model_tflops": fpt * tokens / s["step_s"] / 1e12,
        "executed_tflops": fpt * tokens * ratio / s["step_s"] / 1e12, "work_ratio": ratio,
        "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if GPU else 0.0,
        **(allocator_facts() if GPU else {}),
        "host_peak_gib": sampler.peak_gib, "host_rss_at_batch_end_gib": s["host_rss_max_gib"],
        **trainer_facts(run.module),
        "stall_fraction": stall / s["step_s"], "predicted_exposed_s": engine.get("predicted_exposed_s"),
        "predicted_stall_s": engine.get("predicted_stall_s"),
        "breakdown": {"compute_s": max(0.0, s["step_s"] - stall - waits - s["optimizer_s"]),
                      "h2d_d2h_wait_s": stall, "update_wait_s": waits, "optimizer_after_backward_s": s["optimizer_s"],
                      "cpu_update_busy_s": engine.get("update_busy_s", 0.0),
                      "gpu_update_launch_s": engine.get("device_update_launch_s", 0.0)},
        "steps_timed": s["steps_timed"], "warmup_steps": warmup, "gpu_update_share": s["gpu_update_share"],
        "engine": engine,
        "plan": schedule.counts() if schedule is not None else None,
        "layer_micro_batches": schedule.micro_batches if schedule is not None else None,
        "kept_graphs": timer.plan.graph_layers if timer.plan is not None else None,
        # the rungs an out-of-memory error in the first steps took (then "plan" is the last rung's)
        "oom_rungs": list(run.strategy.run_plan.ladder.taken) if hasattr(run.strategy, "run_plan") else [],
    })
    return row


def search(system: str, shape: str, cap: float | None, steps: int, warmup: int, host_cache: dict) -> dict:
    tried = []
    for batch in MAX_CANDIDATES.get(cap, MAX_CANDIDATES[80.0]):
        row = one_run(system, shape, batch, cap, steps, warmup, host_cache)
        if row["status"] == "ok":
            return {**row, "requested_batch": "max", "refused_batches": tried}
        if not any(k in row["status"] for k in FIT_FAILURES):
            return {**row, "requested_batch": "max", "refused_batches": tried}
        tried.append({"batch": batch, "status": row["status"][:200]})
    return {**row, "requested_batch": "max", "refused_batches": tried, "status": "no candidate batch fits"}


def _key(r: dict) -> tuple:
    return r["system"], r["model"], str(r.get("requested_batch", r["batch"])), r["gpu_cap_gib"]


def save(path: str, runs: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"machine": machine(), "seq": SEQ, "runs": runs}, f, indent=2)
    os.replace(tmp, path)


def print_table(runs: list[dict]) -> None:
    print(f"{'system':30} {'model':12} {'cap':>4} {'batch':>5} {'step s':>7} {'TFLOPS':>7} {'exec':>7} {'GPU GiB':>7}"
          f" {'host GiB':>8} {'stall':>6}")
    for r in runs:
        head = f"{r['system']:30} {r['model']:12} {str(r['gpu_cap_gib']):>4} {r['batch']:>5}"
        if r["status"] != "ok":
            print(f"{head} {r['status'][:70]}")
            continue
        print(f"{head} {r['step_s']:7.2f} {r['model_tflops']:7.1f} {r['executed_tflops']:7.1f} {r['gpu_peak_gib']:7.1f}"
              f" {r['host_peak_gib']:8.1f} {r['stall_fraction']:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["qwen2.5-3b"])
    parser.add_argument("--systems", nargs="+", default=["all"])
    parser.add_argument("--caps", nargs="+", default=["80"], help="GiB, or 'none' for the whole GPU")
    parser.add_argument("--batches", nargs="+", default=["8"],
                        help="batch sizes, 'max' to search, 'same' for lazytrain's")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/run_<commit>_<machine>.json")
    parser.add_argument("--merge", default=None, help="an earlier results file whose runs are kept")
    args = parser.parse_args()
    args.out = args.out or default_out("run")
    systems = list(SYSTEMS) if args.systems == ["all"] else args.systems
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    caps = [None if c == "none" else float(c) for c in args.caps]
    runs: list[dict] = []
    if args.merge and os.path.exists(args.merge):
        with open(args.merge) as f:
            runs = json.load(f)["runs"]
    host_cache: dict = {}
    for shape in args.models:
        for system in systems:
            for cap in [None] if system.startswith("gpu-resident") else caps:
                for batch in args.batches:
                    if batch == "same":  # the batch the lazytrain search found for this model and cap
                        found = [r for r in runs if r["system"] == "lazytrain" and r["model"] == shape
                                 and r["gpu_cap_gib"] == cap and r["status"] == "ok"]
                        batch = str(found[-1]["batch"]) if found else "8"
                    if batch == "max":
                        row = search(system, shape, cap, args.steps, args.warmup, host_cache)
                    else:
                        row = one_run(system, shape, int(batch), cap, args.steps, args.warmup, host_cache)
                    print(json.dumps({k: v for k, v in row.items() if k != "engine"}), flush=True)
                    runs = [r for r in runs if _key(r) != _key(row)] + [row]
                    save(args.out, runs)
        host_cache.clear()
    print_table(runs)


if __name__ == "__main__":
    main()
