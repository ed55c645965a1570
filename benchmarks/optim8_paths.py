"""The CPU AdamW update per kernel code path: torch fused and foreach AdamW, HybridAdamW with fp32 and 8-bit states
on every path of the fused kernel this CPU runs (``$LAZYTRAIN_KERNEL_PATH`` forces each in turn).

Usage: python benchmarks/optim8_paths.py [--numel 16e6 --threads 2 --rounds 3 --paths c/avx2,c/scalar]
One tensor of fp32 params and fp32 gradients (``opt.step()``), the issue's setting: seconds per step, the median
of ``--repeats`` timed steps after ``--warmup`` untimed ones, on ``--threads`` threads. ``--rounds`` times per row,
each right after torch fused AdamW's: the speed against it is the median of the rounds' ratios, which a shared
machine's changing load moves far less than the times themselves. Each row also has the
calling thread's CPU time per parameter on one thread (minimum over the timed steps): on a shared machine the
wall time includes other processes' load, the thread's CPU time much less. Writes
``benchmarks/results/optim8_<commit>_cpu<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.optim_cpu import _commit, _cpu_flags, _cpu_model  # noqa: E402
from lightning_lazytrain.optim import HybridAdamW  # noqa: E402
from lightning_lazytrain.optim.kernel import PATH_ENV, kernel_path, runnable_paths  # noqa: E402


def _time(step, warmup: int, repeats: int) -> tuple[float, float]:
    """(median wall seconds, minimum calling-thread CPU seconds) per step."""
    for _ in range(warmup):
        step()
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return sorted(wall)[len(wall) // 2], min(cpu)


def _opt(make, params: torch.Tensor, grad: torch.Tensor, threads: int):
    torch.set_num_threads(threads)
    p = params.clone().requires_grad_(True)
    p.grad = grad
    return make(p, threads)


def _row(name: str, make, params: torch.Tensor, grad: torch.Tensor, args, path: str | None, fused) -> dict:
    """One optimizer's row: per round, torch fused AdamW timed right before it, so that both see the same load."""
    if path:
        os.environ[PATH_ENV] = path
    walls, fused_walls = [], []
    for _ in range(args.rounds):
        fused_walls.append(_time(_opt(fused, params, grad, args.threads).step, args.warmup, args.repeats)[0])
        opt = _opt(make, params, grad, args.threads)
        if path:
            assert opt.kernel_path == path == kernel_path(), (opt.kernel_path, path)
        walls.append(_time(opt.step, args.warmup, args.repeats)[0])
        del opt
    cpu = _time(_opt(make, params, grad, 1).step, args.warmup, args.repeats)[1]
    ratios = sorted(f / w for f, w in zip(fused_walls, walls, strict=True))
    return {
        "name": name,
        "path": path,
        "wall_s": round(statistics.median(walls), 5),
        "torch_fused_wall_s": round(statistics.median(fused_walls), 5),
        "speed_vs_torch_fused": round(statistics.median(ratios), 3),
        "speed_vs_torch_fused_rounds": [round(r, 3) for r in ratios],
        "cpu_ns_per_param_1thread": round(cpu / params.numel() * 1e9, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=float, default=16e6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="timings per row, each paired with torch fused's")
    ap.add_argument("--paths", default=None, help="comma-separated kernel paths (default: every one this CPU runs)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/optim8_<commit>_cpu<N>.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    n = int(args.numel)
    params, grad = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    forced = os.environ.get(PATH_ENV)
    load_before = os.getloadavg()
    fused = lambda p, t: torch.optim.AdamW([p], lr=1e-4, fused=True)  # noqa: E731
    foreach = lambda p, t: torch.optim.AdamW([p], lr=1e-4, foreach=True)  # noqa: E731
    rows = [
        _row("torch_adamw_fused", fused, params, grad, args, None, fused),
        _row("torch_adamw_foreach", foreach, params, grad, args, None, fused),
    ]
    for path in args.paths.split(",") if args.paths else runnable_paths():
        for frac, states in ((0.0, "fp32"), (1.0, "8bit")):
            make = lambda p, t, f=frac: HybridAdamW([p], lr=1e-4, eight_bit_fraction=f, num_threads=t)  # noqa: E731
            rows.append(_row(f"hybrid_{states}_states", make, params, grad, args, path, fused))
            print(rows[-1], flush=True)
    if forced is None:
        os.environ.pop(PATH_ENV, None)
    else:
        os.environ[PATH_ENV] = forced
    commit = _commit()
    model = _cpu_model()
    out = {
        "command": " ".join([sys.executable, *sys.argv]),
        "git_commit": commit,
        "cpu": {"model": model, "flags": sorted(_cpu_flags()), "nproc": os.cpu_count(), "paths": runnable_paths()},
        "torch": {"version": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability()},
        "setting": {
            "numel": n,
            "threads": args.threads,
            "warmup": args.warmup,
            "repeats": args.repeats,
            "rounds": args.rounds,
            "statistic": "median wall step; speed: median over rounds of torch fused's wall, timed right before,"
            " over the row's; minimum 1-thread CPU step",
            "grad": "fp32",
            "params": "fp32",
        },
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }
    path = Path(args.out or f"benchmarks/results/optim8_{commit[:7]}_cpu{os.cpu_count()}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"{'row':22s} {'path':14s} {'wall s':>8s} {'x fused':>8s} {'1-thread CPU ns/param':>22s}")
    for r in rows:
        print(
            f"{r['name']:22s} {str(r['path']):14s} {r['wall_s']:8.4f} {r['speed_vs_torch_fused']:8.3f} "
            f"{r['cpu_ns_per_param_1thread']:22.3f}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
