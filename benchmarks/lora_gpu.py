"""Issue 38's rows: LoRA and QLoRA over a random-init base at the real shapes, seq 1024, under lazytrain, Lightning's
DeepSpeed ZeRO-3 offload and plain Lightning (expected to run out of memory: the row records the error).

    export LAZYTRAIN_COMMIT=<commit>              # typed into the device's command (common.commit)
    python benchmarks/lora_gpu.py                 # check, lazytrain 27B LoRA and 72B QLoRA, plain, DeepSpeed:
                                                  # as many as --budget-s (540 s) allows, in that order
    python benchmarks/lora_gpu.py --rows deepspeed        # the next call: the rows a first call left out
    python benchmarks/lora_gpu.py --rows 27b|72b|lazytrain|plain|<row name>
    python benchmarks/lora_gpu.py --tiny          # CPU dry run of every row: tiny shapes, a temporary file

Results go to ``benchmarks/results/lora_<commit>_<machine>.json`` (rows already there are kept, the same name
replaced; the file is rewritten after every row). A tiny correctness check (``lora_check.py``) runs first in its
own child; if it fails no timing row runs. Every row runs in its own subprocess under its timeout, capped by what is
left of ``--budget-s`` (a row that would not get 60 s is not started), so one call stays inside the device's limit.
Each row records step s (CUDA events, ``common.StepTimer``), tokens/s, model-TFLOPS (``lora_systems.flop_counts``),
the GPU peak of the fit (``max_memory_allocated``, the build's apart), the host peak (``HostPeakMemory``, sampled
from before the build) and, for lazytrain, what ``lazytrain plan --gpu h200`` predicts for the same batch.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass

from child_process import add_child_arguments, ran_as_child, run_child, write_json
from lora_report import CHECK, print_table, targets

SEQ, TINY_SEQ, GIB = 1024, 128, 2**30


@dataclass
class Row:
    name: str
    system: str  # lora_systems.SYSTEMS
    model: str  # lora_systems.MODELS
    batches: tuple[int, ...]  # from the largest down: the first that fits is run
    timeout_s: int
    warmup: int
    timed: int

    @property
    def groups(self) -> tuple[str, str]:
        """The model size (27b, 72b) and the system's first word (lazytrain, deepspeed, plain)."""
        return self.model.split("-")[-1], self.system.split("-")[0]


# the targets' rows first, then plain Lightning (out of memory within a minute), then DeepSpeed: ``--rows all``
# in one call measures what the budget allows in that order, a second ``--rows deepspeed`` the rest
ROWS = [
    Row("lazytrain-lora-27b", "lazytrain", "lora-27b", (32,), 360, 2, 3),
    # the batch the plan picks for the recipe on an H200 with a 128 GiB host (32: 25.1 s predicted), then half
    Row("lazytrain-qlora-72b", "lazytrain", "qlora-72b", (32, 16), 420, 1, 2),
    Row("plain-lora-27b", "plain", "lora-27b", (32,), 150, 1, 2),
    Row("plain-qlora-72b", "plain", "qlora-72b", (32,), 180, 1, 2),
    Row("deepspeed-z3-offload-lora-27b", "deepspeed-z3-offload", "lora-27b", (32,), 400, 1, 2),
    Row("deepspeed-z3-offload-qlora-72b", "deepspeed-z3-offload", "qlora-72b", (32,), 400, 1, 2),
]
GROUPS = sorted({g for r in ROWS for g in r.groups})
OOM = ("OutOfMemory", "out of memory")


def predicted(model: str, batch: int) -> dict:
    """``lazytrain plan`` for the recipe at ``batch`` on an H200 with this host's available RAM (analytic)."""
    from lora_systems import MODELS
    from plan_query import plan_asked

    asked = plan_asked(*MODELS[model], batch)
    if "error" in asked:
        return asked
    return {
        "batch": batch,
        "fits": asked["fits"],
        "step_s": (asked["prediction"] or {}).get("step_s"),
        "model_tflops": asked["model_tflops"],
        "host_need_gib": asked["tiers"]["host"]["need_bytes"] / GIB,
        "gpu_need_gib": asked["tiers"]["gpu"]["need_bytes"] / GIB,
    }


def status_of(exc: Exception) -> str:
    text = f"{type(exc).__name__}: {exc}"[:400]
    return ("out of memory: " if any(k in text for k in OOM) else "") + text


def fit_once(run, spec: dict, batch: int, seq: int, vocab: int, clip: float, sampler) -> dict:
    """One fit of ``run`` at ``batch``: the timer's summary, or the error as the status."""
    import lightning.pytorch as pl
    import torch
    from common import GPU, RandomTokens, StepTimer

    if GPU:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    timer, steps = StepTimer(), spec["warmup"] + spec["timed"] + 1
    out: dict = {"batch": batch}
    try:  # the row records why a fit fails (plain Lightning is expected to run out of memory)
        trainer = pl.Trainer(
            accelerator="gpu" if GPU else "cpu",
            devices=1,
            strategy=run.strategy(batch),
            precision=run.precision,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[timer, sampler],
            gradient_clip_val=clip,
        )
        data = RandomTokens(steps, batch, seq, vocab=vocab)
        trainer.fit(run.module, torch.utils.data.DataLoader(data, batch_size=None))
        out.update(status="ok", **timer.summary(spec["warmup"]))
    except Exception as exc:
        out["status"] = status_of(exc)
    out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB if GPU else None
    return out


def fit_row(spec: dict) -> dict:
    """Build ``spec``'s system once and fit it at each batch from the largest down until one is not refused."""
    import torch
    from common import GPU
    from lora_systems import build, config_for, flop_counts, recipe
    from run import FIT_FAILURES

    from lightning_lazytrain.host_peak import HostPeakMemory

    sampler = HostPeakMemory()  # from before the build: its "load" phase is the build's host peak
    rec, config = recipe(spec["model"]), config_for(spec["model"], spec["tiny"])
    seq = TINY_SEQ if spec["tiny"] else SEQ
    row = {"lora": asdict(rec.lora), "precision": rec.precision, "seq": seq, **flop_counts(config, rec.lora, seq)}
    start = time.perf_counter()
    tried: list[dict] = []
    try:
        run = build(spec["system"], config, rec)
    except Exception as exc:  # e.g. the GPU-resident base does not fit: the row says so
        run, row["status"] = None, "build failed: " + status_of(exc)
    row.update(build_s=time.perf_counter() - start)
    if GPU:
        row["build_gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    for batch in spec["batches"] if run is not None else []:
        row.update(
            optimizer=run.optimizer,
            note=run.note,
            **fit_once(run, spec, batch, seq, config.vocab_size, rec.clip, sampler),
        )
        if row["status"] == "ok" or not any(k in row["status"] for k in FIT_FAILURES):
            break
        tried.append({"batch": batch, "status": row["status"][:200]})
    sampler.close()
    row.update(
        refused_batches=tried,
        host_peak_gib=sampler.peak_bytes / GIB,
        host_peaks_gib={k: v / GIB for k, v in sampler.peaks.items()},
    )
    if row["status"] == "ok":
        row["tokens_per_s"] = row["batch"] * seq / row["step_s"]
        row["model_tflops"] = row["flops_per_token"] * row["tokens_per_s"] / 1e12
    return row


def child(spec: dict, out: str) -> None:
    """One row (or the check) in this process; its result is written to ``out``."""
    if spec["name"] == CHECK:
        from lora_check import check

        result = check()
    else:
        from qwen27b_gpu import heartbeat  # a kernel OOM kill leaves only this trail

        heartbeat()
        result = fit_row(spec)
    write_json(out, result)


def run_row(spec: dict, timeout_s: float) -> dict:
    failed = {"row": spec["name"], "system": spec.get("system"), "model": spec.get("model")}
    from common import allocator_env

    result, failure, wall = run_child(__file__, spec, allocator_env(spec.get("system") or ""), timeout_s)
    return {**failed, **(result or {"status": failure}), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=["all"], help=f"row names, groups {GROUPS}, or all")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/lora_<commit>_<machine>.json")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on whatever device: a dry run")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole call's limit; rows are cut to it")
    parser.add_argument("--no-plan", action="store_true", help="skip the lazytrain plan prediction (20 s a row)")
    parser.add_argument("--ignore-check", action="store_true", help="time the rows even if the check fails")
    add_child_arguments(parser)
    args = parser.parse_args()
    if ran_as_child(args, child):
        return
    start = time.perf_counter()
    unknown = set(args.rows) - {"all", *GROUPS, *(r.name for r in ROWS)}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from groups {GROUPS} or {[r.name for r in ROWS]}")
    picked = [r for r in ROWS if "all" in args.rows or r.name in args.rows or set(r.groups) & set(args.rows)]
    from common import default_out, write_results

    if args.out is None:
        args.out = os.path.join(tempfile.gettempdir(), "lora_tiny.json") if args.tiny else default_out("lora")
    rows: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = {r["row"]: r for r in json.load(f)["rows"]}

    def save() -> None:
        write_results(
            args.out,
            {
                "group": "lora",
                "tiny": args.tiny,
                "rows": list(rows.values()),
                "targets": targets(rows),
                "wall_s": time.perf_counter() - start,
            },
        )

    rows[CHECK] = {"row": CHECK, **run_row({"name": CHECK}, 120)}
    print(json.dumps(rows[CHECK], default=str), flush=True)
    save()
    for row in picked:
        left = args.budget_s - (time.perf_counter() - start)
        spec = {**asdict(row), "tiny": args.tiny}
        if args.tiny:
            spec["batches"] = [4, 2] if len(row.batches) > 1 else [2]
        if rows[CHECK]["status"] != "ok" and not args.ignore_check:
            result = {"row": row.name, "status": "not run: the correctness check failed"}
        elif left < 60:
            result = {"row": row.name, "status": f"not run: {left:.0f} s of --budget-s left"}
        else:
            plan = predicted(row.model, spec["batches"][0]) if row.system == "lazytrain" and not args.no_plan else None
            left = args.budget_s - (time.perf_counter() - start)
            result = {**run_row(spec, min(row.timeout_s, left)), "plan": plan}
        rows[row.name] = {"groups": list(row.groups), **result}
        print(
            json.dumps({k: v for k, v in result.items() if k not in ("engine", "step_s_each")}, default=str), flush=True
        )
        save()
    print_table(rows)


if __name__ == "__main__":
    main()
