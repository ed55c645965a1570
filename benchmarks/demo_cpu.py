"""The CPU demo recipe, measured: untrained and trained exact match, wall time, per torch thread count.

Usage: python benchmarks/demo_cpu.py [--threads 1 2] [--out FILE] [-- EXTRA CLI ARGS]

For each thread count, runs ``lazytrain validate --config demo`` (the untrained model: the recipe's seed gives fit
the same initial weights) and ``lazytrain fit --config demo`` as subprocesses with ``OMP_NUM_THREADS`` set, each
logging to a fresh directory, and reads the numbers from the runs' own ``metrics.csv``. The thread count changes
the order of float sums in the matrix products, so the runs are not bit-identical across thread counts (or
machines); the JSON keeps every run and the spread of the final exact match. Arguments after ``--`` go to both
commands (``-- --trainer.max_steps 10`` for a quick check of the script).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, as the runs (python -m, cwd = ROOT) use it
METRICS = ("val/exact_match", "val/loss", "val/token_acc")


def _commit() -> str:
    if os.environ.get("LAZYTRAIN_COMMIT"):  # a copied working tree may carry a stale .git
        return os.environ["LAZYTRAIN_COMMIT"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
    ).stdout.strip()
    return (head.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _machine() -> dict:
    import torch

    from lightning_lazytrain.optim import kernel_path

    return {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "optimizer_kernel_path": kernel_path(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in ("torch", "transformers", "lightning")},
    }


def _rows(save_dir: Path) -> list[dict]:
    files = sorted(save_dir.glob("**/metrics.csv"))
    if len(files) != 1:
        raise RuntimeError(f"expected one metrics.csv under {save_dir}, found {len(files)}")
    with open(files[0], newline="") as f:
        return list(csv.DictReader(f))


def _validations(rows: list[dict]) -> list[dict]:
    """One entry per validation: its step and the metrics it logged (the CSV logs them on their own rows)."""
    out = []
    for row in rows:
        if row.get("val/exact_match"):
            entry = {"step": int(row["step"]) + 1 if row.get("step") else None}  # Lightning logs the 0-based step
            entry.update({k: round(float(row[k]), 4) for k in METRICS if row.get(k)})
            out.append(entry)
    return out


def _run(cmd: list[str], threads: int, save_dir: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    args = [*cmd, "--trainer.logger.init_args.save_dir", str(save_dir)]
    print("+", " ".join(args), f"(OMP_NUM_THREADS={threads})", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(args, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited with status {proc.returncode}")
    return wall


def _torch_threads(threads: int) -> int:
    """What torch.get_num_threads() says under the environment the runs get (the optimizer kernel uses it too)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout)


def measure(threads: int, extra: list[str], work: Path) -> dict:
    base = [sys.executable, "-m", "lightning_lazytrain.sft.cli"]
    validate_cmd = [*base, "validate", "--config", "demo", *extra]
    fit_cmd = [*base, "fit", "--config", "demo", *extra]
    _run(validate_cmd, threads, work / f"untrained_{threads}")
    untrained = _validations(_rows(work / f"untrained_{threads}"))[-1]
    untrained.pop("step", None)
    wall = _run(fit_cmd, threads, work / f"fit_{threads}")
    rows = _rows(work / f"fit_{threads}")
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    during = _validations(rows)
    return {
        "omp_num_threads": threads,
        "torch_threads": _torch_threads(threads),
        "untrained": untrained,
        "during_training": during,
        "trained_exact_match": during[-1]["val/exact_match"],
        "train_loss_first_last_logged": [round(losses[0], 4), round(losses[-1], 4)] if losses else None,
        "fit_wall_s": round(wall, 1),
    }


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default=None, help="default: benchmarks/results/demo_<commit>_cpu<cores>.json")
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    from results_index import result_path  # beside this script

    args.out = args.out or str(ROOT / result_path("demo", f"cpu{os.cpu_count()}"))
    with tempfile.TemporaryDirectory(prefix="demo_cpu_") as tmp:
        runs = [measure(t, extra, Path(tmp)) for t in args.threads]
    final = [r["trained_exact_match"] for r in runs]
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "runs_commands": [" ".join(["lazytrain", sub, "--config", "demo", *extra]) for sub in ("validate", "fit")],
        "commit": _commit(),
        "machine": _machine(),
        "runs": runs,
        "trained_exact_match_min_max": [min(final), max(final)],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"trained_exact_match": final, "wall_s": [r["fit_wall_s"] for r in runs]}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
