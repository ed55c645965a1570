"""The fair baseline suite and the targets of issue 16, one table regenerated at one commit.

    python benchmarks/suite_gpu.py --rows p2 --out benchmarks/results/suite_h200.json
    python benchmarks/suite_gpu.py --rows megatrain|7b|ceiling|p5 --out benchmarks/results/suite_h200.json
    python benchmarks/suite_gpu.py --rows all --tiny --out /tmp/suite_cpu.json     # CPU dry run

Every row runs in its own subprocess (no host model, pinned cache or allocator state is shared between systems)
under a per-row timeout. Each group fits one device call of under 10 minutes. Rows already in ``--out`` from
other groups are kept (same name: replaced), the file is rewritten after each row, and the ratios of the targets
are recomputed over all rows, each naming the batches it compares.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Row:
    name: str
    group: str
    system: str
    shape: str
    batches: tuple[int, ...]  # one batch, or candidates from the largest down: the first that fits is run
    cap_gib: float | None
    timeout_s: int
    steps: int = 5
    warmup: int = 1
    env: dict = field(default_factory=dict)


ROWS = [
    Row("lazytrain-3b-b8", "p2", "lazytrain", "qwen2.5-3b", (8,), 80.0, 150, 6, 2),
    Row("lazytrain-gpu-updates-plan-3b-b8", "p2", "lazytrain-gpu-updates-plan", "qwen2.5-3b", (8,), 80.0, 150, 6, 2),
    Row("fsdp-offload-3b-b8-adamw-default", "p2", "fsdp-cpu-offload", "qwen2.5-3b", (8,), 80.0, 130),
    Row("fsdp-offload-3b-b8-adamw-fused", "p2", "fsdp-cpu-offload-fused", "qwen2.5-3b", (8,), 80.0, 120),
    Row("deepspeed-z3-offload-fair-3b-b8", "p2", "deepspeed-z3-offload-fair", "qwen2.5-3b", (8,), 80.0, 160),
    Row("megatrain-interval4-after-backward-3b-b8", "megatrain", "lazytrain-interval4", "qwen2.5-3b", (8,), 80.0, 200),
    Row(
        "megatrain-interval4-overlapped-3b-b8",
        "megatrain",
        "lazytrain-interval4-overlap",
        "qwen2.5-3b",
        (8,),
        80.0,
        150,
    ),
    # from the largest batch down: batch 96 ran at 385.4 model-TFLOPS where 144 ran at 435.3 on the same H200
    # (suite_p1_h200.json, suite_kernels_h200.json), so the search starts above the paper's batch
    Row("lazytrain-7b-80g-max", "7b", "lazytrain", "qwen2.5-7b", (192, 160, 144, 96, 64), 80.0, 300, 4, 1,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    Row(
        "lazytrain-7b-80g-b144-expandable",
        "7b",
        "lazytrain",
        "qwen2.5-7b",
        (144,),
        80.0,
        280,
        4,
        1,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    ),
    Row(
        "lazytrain-hf-kernels-7b-80g-b144-expandable",
        "kernels",
        "lazytrain-hf-kernels",
        "qwen2.5-7b",
        (144,),
        80.0,
        280,
        4,
        1,
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    ),
    Row("resident-7b-max", "ceiling", "gpu-resident", "qwen2.5-7b", (24, 16, 12, 8, 4), None, 240, 5, 1),
    Row("resident-ckpt-7b-max", "ceiling", "gpu-resident-ckpt", "qwen2.5-7b", (96, 64, 48, 32, 16), None, 300, 5, 1),
    Row("resident-liger-7b-max", "ceiling", "gpu-resident-liger", "qwen2.5-7b", (24, 16, 12, 8, 4), None, 240, 5, 1),
    Row("resident-ckpt-liger-7b-max", "ceiling", "gpu-resident-ckpt-liger", "qwen2.5-7b", (96, 64, 48, 32, 16), None,
        300, 5, 1),
    Row("lazytrain-7b-24g-b32", "p5", "lazytrain", "qwen2.5-7b", (32,), 24.0, 420, 5, 1),
    # the 24 GiB cap at three times P5's batch: whole-batch layers, then each layer in four row slices
    Row("lazytrain-7b-24g-b96", "p5", "lazytrain-whole-batch", "qwen2.5-7b", (96,), 24.0, 420, 4, 1),
    Row("lazytrain-7b-24g-micro4-b96", "p5", "lazytrain-micro4", "qwen2.5-7b", (96,), 24.0, 480, 4, 1),
    # the MILP's own choice of slices (layer_micro_batches="auto") at up to twice that batch under the same cap
    Row("lazytrain-7b-24g-auto-max", "p5", "lazytrain", "qwen2.5-7b", (192, 160, 128), 24.0, 540, 4, 1),
]
GROUPS = sorted({r.group for r in ROWS})


def child(spec: dict, out: str) -> None:
    """Runs one row in this process and writes its result to ``out``."""
    from run import FIT_FAILURES, one_run

    tried = []
    for batch in spec["batches"]:
        result = one_run(spec["system"], spec["shape"], batch, spec["cap_gib"], spec["steps"], spec["warmup"], {})
        if result["status"] == "ok" or not any(k in result["status"] for k in FIT_FAILURES):
            break
        tried.append({"batch": batch, "status": result["status"][:200]})
    engine = result.pop("engine", {}) or {}
    result.update(
        {
            "row": spec["name"],
            "group": spec["group"],
            "refused_batches": tried,
            "env": spec["env"],
            "stall_s": engine.get("stall_s"),
            # the link waits the plan predicts (its unhidden transfers and the step-start weight copy)
            "predicted_stall_s": engine.get("predicted_stall_s"),
            "update_wait_s": engine.get("update_wait_s"),
            "engine": engine,
        }
    )
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, default=str)
    os.replace(tmp, out)


def run_row(row: Row, tiny: bool) -> dict:
    spec = asdict(row)
    if tiny:
        spec.update(
            shape="tiny",
            batches=[4, 2] if len(row.batches) > 1 else [2],
            steps=3,
            warmup=1,
            cap_gib=None if row.cap_gib is None else row.cap_gib,
        )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        from common import allocator_env

        spec["env"] = {**allocator_env(row.system), **row.env}
        # the child imports this checkout, installed or not
        path = os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env = {**os.environ, **spec["env"], "PYTHONPATH": path}
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out]
        try:
            proc = subprocess.run(cmd, env=env, timeout=row.timeout_s, cwd=os.getcwd())
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            return {"row": row.name, "group": row.group, "system": row.system, "status": f"timeout {row.timeout_s}s"}
        if not os.path.exists(out):
            return {"row": row.name, "group": row.group, "system": row.system, "status": f"child exited {rc}"}
        with open(out) as f:
            return json.load(f)


def _ok(rows: dict, name: str) -> dict | None:
    r = rows.get(name)
    return r if r is not None and r.get("status") == "ok" else None


def _ratio(rows: dict, num: str, den: str, target: float | None, key: str = "model_tflops") -> dict | None:
    a, b = _ok(rows, num), _ok(rows, den)
    if a is None or b is None:
        return None
    value = a[key] / b[key]
    return {
        "value": value,
        "of": f"{num} (batch {a['batch']}) / {den} (batch {b['batch']})",
        "by": key,
        "target": target,
        "met": None if target is None else value >= target,
    }


def targets(rows: dict) -> dict:
    fsdp = [n for n in ("fsdp-offload-3b-b8-adamw-default", "fsdp-offload-3b-b8-adamw-fused") if _ok(rows, n)]
    faster_fsdp = max(fsdp, key=lambda n: rows[n]["model_tflops"]) if fsdp else "fsdp-offload-3b-b8-adamw-fused"
    ceiling = [n for n in ("resident-7b-max", "resident-ckpt-7b-max", "resident-liger-7b-max",
                           "resident-ckpt-liger-7b-max") if _ok(rows, n)]
    best_ceiling = max(ceiling, key=lambda n: rows[n]["model_tflops"]) if ceiling else "resident-7b-max"
    ours = [n for n in ("lazytrain-3b-b8", "lazytrain-gpu-updates-plan-3b-b8") if _ok(rows, n)]
    best_3b = max(ours, key=lambda n: rows[n]["model_tflops"]) if ours else "lazytrain-3b-b8"  # the row names it
    out = {
        "P1 lazytrain 7B 80 GiB vs resident ceiling": _ratio(rows, "lazytrain-7b-80g-max", best_ceiling, 0.9),
        "P2 vs fair DeepSpeed": _ratio(rows, best_3b, "deepspeed-z3-offload-fair-3b-b8", 3.0),
        "P2 vs the faster FSDP": _ratio(rows, best_3b, faster_fsdp, 2.0),
        "lazytrain vs MegaTrain policy (3B b8)": _ratio(
            rows, "lazytrain-3b-b8", "megatrain-interval4-after-backward-3b-b8", None
        ),
    }
    p5 = _ok(rows, "lazytrain-7b-24g-b32")
    if p5:
        stall, predicted = p5.get("stall_s") or 0.0, p5.get("predicted_stall_s")
        out["P5 7B 24 GiB b32"] = {
            "model_tflops": p5["model_tflops"],
            "tflops_target": 280.0,
            "stall_fraction": stall / p5["step_s"],
            "stall_fraction_target": 0.05,
            "stall_s": stall,
            "predicted_stall_s": predicted,
            "plan": p5.get("plan"),
            "within_2x": None if not predicted else predicted / 2 <= stall <= 2 * predicted,
        }
    paper = _ok(rows, "lazytrain-7b-80g-b144-expandable")
    if paper:
        out["paper 7B b144"] = {
            "model_tflops": paper["model_tflops"],
            "target": 450.0,
            "vs_paper_199.8": paper["model_tflops"] / 199.8,
        }
    return out


def save(path: str, rows: dict) -> None:
    from common import commit, machine

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "commit": commit(),
                "machine": machine(),
                "seq": 1024,
                "targets": targets(rows),
                "rows": list(rows.values()),
            },
            f,
            indent=2,
            default=str,
        )
    os.replace(tmp, path)


def print_table(rows: dict) -> None:
    print(f"{'row':42} {'batch':>5} {'step s':>7} {'TFLOPS':>7} {'tok/s':>8} {'GPU GiB':>7} {'host GiB':>8}  kernel")
    for r in rows.values():
        if r.get("status") != "ok":
            print(f"{r['row']:42} {str(r.get('status'))[:80]}")
            continue
        print(
            f"{r['row']:42} {r['batch']:>5} {r['step_s']:7.3f} {r['model_tflops']:7.1f} {r['tokens_per_s']:8.0f}"
            f" {r['gpu_peak_gib']:7.1f} {r['host_peak_gib']:8.1f}  {r.get('kernel_path')}"
        )
    for name, t in targets(rows).items():
        if t is not None:
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=["all"], help=f"row names or groups {GROUPS}, or all")
    parser.add_argument("--out", default="benchmarks/results/suite_h200.json")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on whatever device: a dry run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child), args.child_out)
        return
    picked = [r for r in ROWS if "all" in args.rows or r.name in args.rows or r.group in args.rows]
    unknown = set(args.rows) - {"all", *GROUPS, *(r.name for r in ROWS)}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from groups {GROUPS} or {[r.name for r in ROWS]}")
    rows: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = {r["row"]: r for r in json.load(f)["rows"]}
    for row in picked:
        result = run_row(row, args.tiny)
        rows[row.name] = result
        print(json.dumps({k: v for k, v in result.items() if k != "engine"}, default=str), flush=True)
        save(args.out, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
