"""A/B of two checkouts of the library (issue 15: the refactor must not slow the step), one harness (this one).

    git archive a278320 | tar -x -C ab_old
    python benchmarks/ab_gpu.py --a ab_old --b . --out benchmarks/results/ab_refactor_h200.json
    python benchmarks/ab_gpu.py --a ab_old --b . --cases 3b-b8 --tiny --out /tmp/ab_cpu.json   # CPU dry run

Cases: Qwen2.5-7B shape under an 80 GiB cap at batch 64, and 3B at batch 8 (system ``lazytrain``). Runs alternate
A, B, A, B, ... so drift of the machine hits both alike; each run is its own subprocess with PYTHONPATH at its
checkout (it records which ``lightning_lazytrain`` it imported). The file is rewritten after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {"7b-b64-80g": ("qwen2.5-7b", 64, 80.0, 150), "3b-b8": ("qwen2.5-3b", 8, 80.0, 90)}


def child(spec: dict, out: str) -> None:
    sys.path.insert(0, HERE)
    from run import one_run

    import lightning_lazytrain

    row = one_run("lazytrain", spec["shape"], spec["batch"], spec["cap"], spec["steps"], spec["warmup"], {})
    row.pop("engine", None)
    row["library"] = os.path.dirname(os.path.abspath(lightning_lazytrain.__file__))
    with open(out + ".tmp", "w") as f:
        json.dump(row, f, default=str)
    os.replace(out + ".tmp", out)


def one(checkout: str, case: str, steps: int, warmup: int, tiny: bool) -> dict:
    shape, batch, cap, timeout = CASES[case]
    spec = {
        "shape": "tiny" if tiny else shape,
        "batch": 2 if tiny else batch,
        "cap": cap,
        "steps": steps,
        "warmup": warmup,
    }
    checkout = os.path.abspath(checkout)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec), "--child-out", out]
        try:
            subprocess.run(cmd, env=env, timeout=timeout if not tiny else 600, cwd=checkout)
        except subprocess.TimeoutExpired:
            return {"status": f"timeout {timeout}s"}
        if not os.path.exists(out):
            return {"status": "child failed"}
        with open(out) as f:
            row = json.load(f)
    if not row.get("library", "").startswith(checkout):
        row["status"] = f"imported {row.get('library')}, not the checkout {checkout}"
    return row


def summarize(runs: list[dict]) -> dict:
    out = {}
    for case in sorted({r["case"] for r in runs}):
        side = {}
        for name in ("a", "b"):
            steps = [r["step_s"] for r in runs if r["case"] == case and r["side"] == name and r.get("status") == "ok"]
            side[name] = {
                "runs": len(steps),
                "median_step_s": statistics.median(steps) if steps else None,
                "steps": steps,
            }
        a, b = side["a"]["median_step_s"], side["b"]["median_step_s"]
        out[case] = {**side, "b_over_a": b / a if a and b else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", help="the old checkout (its lightning_lazytrain/ is imported)")
    parser.add_argument("--b", default=".", help="the new checkout")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--runs", type=int, default=3, help="runs per side and case")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/ab_refactor_h200.json")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child), args.child_out)
        return
    if args.a is None:
        parser.error("--a (the old checkout) is required")
    sys.path.insert(0, HERE)
    from common import machine

    runs: list[dict] = []
    out = os.path.abspath(args.out)
    for case in args.cases:
        for i in range(args.runs):
            for side, checkout in (("a", args.a), ("b", args.b)):
                row = {
                    "case": case,
                    "side": side,
                    "checkout": checkout,
                    "run": i,
                    **one(checkout, case, args.steps, args.warmup, args.tiny),
                }
                runs.append(row)
                print(
                    json.dumps({k: row.get(k) for k in ("case", "side", "run", "status", "step_s", "library")}),
                    flush=True,
                )
                os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
                with open(out + ".tmp", "w") as f:
                    json.dump(
                        {"machine": machine(), "a": args.a, "b": args.b, "summary": summarize(runs), "runs": runs},
                        f,
                        indent=2,
                        default=str,
                    )
                os.replace(out + ".tmp", out)
    for case, s in summarize(runs).items():
        print(case, "A", s["a"]["median_step_s"], "B", s["b"]["median_step_s"], "B/A", s["b_over_a"])


if __name__ == "__main__":
    main()
