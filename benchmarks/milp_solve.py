"""Solve-time benchmark of the placement MILP on CPU for 28-, 48- and 64-layer problems from realistic shapes.

Run: ``python benchmarks/milp_solve.py [--time-limit 10] [--gap 0.01] [--out FILE]``

Numbers per layer are analytic (no GPU here): activation bytes = batch * seq * hidden * 2 (bf16 hidden state),
forward seconds = 2 * params_per_layer * tokens / 400e12 FLOP/s (one third of the 6N training FLOPs), window
= 3x forward (forward + backward), param H2D per window = bf16 weights streamed twice (forward and backward),
grad D2H = bf16 grads once. PCIe 55e9 B/s each way, NVMe 1.28e9 read / 0.51e9 write (H200 machine, REFERENCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_lazytrain.schedule import ScheduleProblem, solve  # noqa: E402

GIB = 1 << 30
FLOPS = 400e12

# name: (layers, hidden, params per layer, batch, seq); params per layer from the HF configs' matrix shapes.
SHAPES = {
    "qwen2.5-7b": (28, 3584, 233.0e6, 32, 1024),
    "qwen2.5-14b": (48, 5120, 275.3e6, 24, 1024),
    "qwen3.6-27b": (64, 5120, 350.2e6, 16, 1024),
}


def realistic_problem(layers: int, hidden: int, params: float, batch: int, seq: int, *, gpu_frac: float,
                      cpu_frac: float, nvme_frac: float, span: int = 4, h2d: float = 55e9, d2h: float = 55e9,
                      nvme_r: float = 1.28e9, nvme_w: float = 0.51e9, fwd_s: float | None = None,
                      budgets: tuple[int, int, int] | None = None) -> ScheduleProblem:
    act = batch * seq * hidden * 2
    total = act * (layers + 1)
    tokens = batch * seq
    fwd = fwd_s if fwd_s is not None else 2 * params * tokens / FLOPS
    # A slight per-layer variation (first/last layers are slower in practice) keeps ties from dominating.
    fwd_list = [fwd * (1.0 + 0.02 * ((j * 7) % 5)) for j in range(layers)]
    if budgets is None:
        budgets = (int(gpu_frac * total), int(cpu_frac * total), int(nvme_frac * total))
    return ScheduleProblem(
        activation_bytes=[act] * (layers + 1), forward_seconds=fwd_list,
        window_seconds=[3 * f for f in fwd_list], param_h2d_bytes=[int(4 * params)] * layers,
        grad_d2h_bytes=[int(2 * params)] * layers, gpu_budget_bytes=budgets[0], cpu_budget_bytes=budgets[1],
        nvme_budget_bytes=budgets[2], h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h, nvme_read_bytes_per_s=nvme_r,
        nvme_write_bytes_per_s=nvme_w, max_recompute_span=span)


def paper_27b() -> ScheduleProblem:
    """REFERENCE.md's published 27B setting: batch 72, seq 1024, 0.703 GiB/boundary, 21.55/15/32 GiB, PCIe 12 GB/s."""
    layers, hidden, params, batch, seq = SHAPES["qwen3.6-27b"][:3] + (72, 1024)
    return realistic_problem(layers, hidden, params, batch, seq, gpu_frac=0, cpu_frac=0, nvme_frac=0,
                             h2d=12e9, d2h=12e9, nvme_r=2.83e9, nvme_w=3.35e9,
                             budgets=(int(21.55 * GIB), int(15 * GIB), int(32 * GIB)))


def with_layer_choices(prob: ScheduleProblem, params: float, graphs_that_fit: int = 6) -> ScheduleProblem:
    """The same problem with the per-layer choices of `milp_memory.py`: a kept graph holds 36 boundaries' worth
    (the analytic estimate of `layer_memory.py` for these shapes, bf16: about 36x the hidden state), the working
    set is 48 boundaries plus the weight gradients, slots hold bf16 weights, 2 prefetch slots; the device total
    leaves room for the activation budget plus about ``graphs_that_fit`` kept graphs and their slots."""
    act, n, slot = prob.activation_bytes[0], prob.num_layers, int(2 * params)
    graph, work = 36 * act, 48 * act + slot
    total = prob.gpu_budget_bytes + 2 * slot + 4 * slot + work + graphs_that_fit * (graph + slot)
    return replace(prob, graph_bytes=[graph] * n, working_bytes=[work] * n, slot_bytes=slot, fixed_slots=2,
                   head_working_bytes=3 * (1 << 29) + 2 * act, gpu_total_bytes=total,
                   gpu_budget_bytes=prob.gpu_budget_bytes + graphs_that_fit * graph)


def cases() -> dict[str, ScheduleProblem]:
    out = {}
    for name, shape in SHAPES.items():
        # Budgets well below "everything on the GPU" so the solver must mix homes and recompute.
        out[f"{name}-L{shape[0]}"] = realistic_problem(*shape, gpu_frac=0.3, cpu_frac=0.25, nvme_frac=0.2)
        out[f"{name}-L{shape[0]}-layer-choices"] = with_layer_choices(out[f"{name}-L{shape[0]}"], shape[2])
    out["paper-27b-L64"] = paper_27b()
    return out


def _machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version()}


def _commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--gap", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-sweep", action="store_true", help="skip the 32-problem 64-layer robustness sweep")
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/milp_solve_<commit>_cpu<cores>.json")
    args = ap.parse_args()
    from results_index import result_path  # beside this script

    args.out = args.out or result_path("milp_solve", f"cpu{os.cpu_count()}")
    results = {}
    for name, prob in cases().items():
        if args.only and args.only not in name:
            continue
        runs = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            s = solve(prob, time_limit=args.time_limit, mip_gap=args.gap)
            runs.append(time.perf_counter() - t0)
        results[name] = {
            "layers": prob.num_layers, "activation_gib_per_boundary": prob.activation_bytes[1] / GIB,
            "budgets_gib": [prob.gpu_budget_bytes / GIB, prob.cpu_budget_bytes / GIB, prob.nvme_budget_bytes / GIB],
            "max_recompute_span": prob.max_recompute_span,
            "solve_seconds": runs, "solve_seconds_median": sorted(runs)[len(runs) // 2],
            "build_seconds": s.info["build_seconds"], "gap": s.info["mip_gap"], "status": s.status,
            "objective": s.objective, "predicted_exposed_seconds": s.predicted_exposed_seconds,
            "recompute_seconds": s.info["recompute_seconds"], "slack_seconds": s.info["slack_seconds"],
            "counts": s.counts(), "homes": "".join(t[0] for t in s.homes),
            "kept_graphs": sum(s.keep_graph), "gpu_gib": s.info["gpu_bytes"] / GIB,
        }
        print(f"{name}: {results[name]['solve_seconds_median']:.2f} s  status={s.status}  gap={s.info['mip_gap']:.4f}"
              f"  counts={s.counts()}  kept graphs={sum(s.keep_graph)}  exposed={s.predicted_exposed_seconds:.4f} s",
              flush=True)
    sweep = []
    if not args.only and not args.no_sweep:
        # Robustness of the 64-layer solve time: spans x budget mixes x PCIe speed, one solve each.
        shape = SHAPES["qwen3.6-27b"]
        for span in (2, 4, 8, 16):
            for fracs in ((0.3, 0.25, 0.2), (0.15, 0.15, 0.15), (0.5, 0.3, 0.3), (0.1, 0.4, 0.4)):
                for bw in (55e9, 12e9):
                    prob = realistic_problem(*shape, gpu_frac=fracs[0], cpu_frac=fracs[1], nvme_frac=fracs[2],
                                             span=span, h2d=bw, d2h=bw)
                    row = {"span": span, "budget_fracs": fracs, "pcie_bytes_per_s": bw}
                    t0 = time.perf_counter()
                    try:
                        s = solve(prob, time_limit=args.time_limit, mip_gap=args.gap)
                        row.update(solve_seconds=time.perf_counter() - t0, status=s.status, gap=s.info["mip_gap"],
                                   counts=s.counts(), predicted_exposed_seconds=s.predicted_exposed_seconds)
                    except ValueError as e:
                        row.update(solve_seconds=time.perf_counter() - t0, status="infeasible", error=str(e)[:120])
                    sweep.append(row)
        times = sorted(r["solve_seconds"] for r in sweep)
        print(f"sweep L64: {len(sweep)} problems, median {times[len(times) // 2]:.2f} s, max {times[-1]:.2f} s")
    doc = {"command": " ".join([Path(sys.executable).name] + sys.argv), "git_commit": _commit(),
           "machine": _machine(), "time_limit": args.time_limit, "mip_gap": args.gap, "results": results,
           "sweep_qwen3.6-27b-L64": sweep}
    if not args.only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
