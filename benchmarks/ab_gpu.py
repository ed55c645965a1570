"""Side-by-side runs of checkouts and systems in one call, one harness (this one).

Issue 15 (the refactor must not slow the step) and issue 17 (one-rank NCCL within 3% of one process):

    git archive a278320 lightning_lazytrain | tar -x -C ab_old
    python benchmarks/ab_gpu.py --side old=ab_old --side new=. --side nccl1=.:lazytrain-one-rank-nccl \
        --cases 3b-b8 --out benchmarks/results/ab_h200.json
    python benchmarks/ab_gpu.py --side old=ab_old --side new=. --cases 3b-b8 --tiny --runs 1 --out /tmp/ab.json

A side is ``NAME=CHECKOUT[:SYSTEM]`` (system ``lazytrain`` unless named). Cases: Qwen2.5-7B shape under an
80 GiB cap at batch 64, and 3B at batch 8. Runs alternate over the sides (old, new, nccl1, old, ...) so drift of
the machine hits all alike; each run is its own subprocess with PYTHONPATH at its checkout (it records which
``lightning_lazytrain`` it imported). The file is rewritten after each run; ratios are of medians against the
first side, at the same case (same shape, batch and cap).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from child_process import add_child_arguments, ran_as_child, run_child, write_json

CASES = {"7b-b64-80g": ("qwen2.5-7b", 64, 80.0, 150), "3b-b8": ("qwen2.5-3b", 8, 80.0, 90)}


def child(spec: dict, out: str) -> None:
    from run import one_run

    import lightning_lazytrain

    row = one_run(spec["system"], spec["shape"], spec["batch"], spec["cap"], spec["steps"], spec["warmup"], {})
    row["library"] = os.path.dirname(os.path.abspath(lightning_lazytrain.__file__))
    write_json(out, row)


def parse_side(text: str) -> tuple[str, str, str]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"--side {text!r}: write NAME=CHECKOUT or NAME=CHECKOUT:SYSTEM")
    checkout, _, system = rest.partition(":")
    return name, checkout, system or "lazytrain"


def one(checkout: str, system: str, case: str, steps: int, warmup: int, tiny: bool) -> dict:
    shape, batch, cap, timeout = CASES[case]
    spec = {
        "system": system,
        "shape": "tiny" if tiny else shape,
        "batch": 2 if tiny else batch,
        "cap": cap,
        "steps": steps,
        "warmup": warmup,
    }
    checkout = os.path.abspath(checkout)
    from common import allocator_env  # a script's own folder is on sys.path

    env = allocator_env(system)
    row, why, wall = run_child(__file__, spec, env, timeout if not tiny else 600, checkout=checkout, cwd=checkout)
    if row is None:
        return {"status": why, "wall_s": wall}
    row["wall_s"] = wall
    row["allocator"] = {**os.environ, **env}.get("PYTORCH_CUDA_ALLOC_CONF")
    if not row.get("library", "").startswith(checkout):
        row["status"] = f"imported {row.get('library')}, not the checkout {checkout}"
    return row


def summarize(runs: list[dict], sides: list[str]) -> dict:
    out = {}
    for case in sorted({r["case"] for r in runs}):
        side = {}
        for name in sides:
            steps = [r["step_s"] for r in runs if r["case"] == case and r["side"] == name and r.get("status") == "ok"]
            side[name] = {"runs": len(steps), "median_step_s": statistics.median(steps) if steps else None,
                          "steps": steps}
        first = side[sides[0]]["median_step_s"]
        for name in sides[1:]:
            med = side[name]["median_step_s"]
            side[name][f"over_{sides[0]}"] = med / first if med and first else None
        out[case] = side
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", type=parse_side, action="append", required=False,
                        help="NAME=CHECKOUT[:SYSTEM], repeated; the first is the reference of the ratios")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--runs", type=int, default=3, help="runs per side and case")
    # the first step after the first update carries one-time work (resident homes copied in, kernels compiled or
    # loaded): with 3 steps and 1 warm-up it was the only interval timed
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/ab_h200.json")
    parser.add_argument("--tiny", action="store_true")
    add_child_arguments(parser)
    args = parser.parse_args()
    if ran_as_child(args, child):
        return
    if not args.side or len(args.side) < 2:
        parser.error("name at least two --side NAME=CHECKOUT[:SYSTEM]")
    from common import commit, machine

    names = [name for name, _, _ in args.side]
    runs: list[dict] = []
    out = os.path.abspath(args.out)
    for case in args.cases:
        for i in range(args.runs):
            for name, checkout, system in args.side:
                row = {"case": case, "side": name, "checkout": checkout, "system": system, "run": i,
                       **one(checkout, system, case, args.steps, args.warmup, args.tiny)}
                runs.append(row)
                print(json.dumps({k: row.get(k) for k in ("case", "side", "run", "status", "step_s", "wall_s")}),
                      flush=True)
                os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
                with open(out + ".tmp", "w") as f:
                    json.dump({"command": " ".join(["python", *sys.argv]), "commit": commit(), "machine": machine(),
                               "sides": args.side, "summary": summarize(runs, names), "runs": runs},
                              f, indent=2, default=str)
                os.replace(out + ".tmp", out)
    for case, s in summarize(runs, names).items():
        print(case, {n: (v["median_step_s"], v.get(f"over_{names[0]}")) for n, v in s.items()})


if __name__ == "__main__":
    main()
