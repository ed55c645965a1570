"""P6 of issue 16: the largest placement MILP the planner builds today, for a 64-layer shape, solved on 2 cores.

Run (pin it to two cores, as the target says):
``taskset -c 0,1 python benchmarks/milp_solve_2core.py [--out FILE]``

The problem is what ``planning.solve.solve_plan`` builds on the CPU, for the Qwen3.6-27B shape (``NAMED_SHAPES``) built
on the meta device: `analytic_profile` for the H200 (times from FLOPs, the published link figures, and
the per-layer graph and working-set bytes `profile_model` gives off CUDA), built by `plan_problem`, every
option that enlarges it on: per-layer kept graphs (two binaries per layer: the whole graph, or the graph with
the MLP re-run), the device total with slots and each
block's working set, ``max_recompute_span`` 4 (the strategy's default) and 8, and both transfer models (the paper's
aggregated windows, the default; ``engine_windows=True``, the engine's rules). The update-placement MILP
(`milp_updates.py`, one binary per streamed unit) is solved for the same shape and timed on its own: it shares no
variable with the placement. HiGHS gets ``threads=2``, a 1% gap and the planner's 10 s limit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_lazytrain.engine.loss.chunked import LOSS_CHUNK_BYTES  # noqa: E402
from lightning_lazytrain.models.adapter import adapter_for  # noqa: E402
from lightning_lazytrain.schedule import solve  # noqa: E402
from lightning_lazytrain.schedule.analytic import analytic_profile, gpu_layout  # noqa: E402
from lightning_lazytrain.schedule.gpus import gpu_spec  # noqa: E402
from lightning_lazytrain.schedule.milp_updates import UpdateProblem, solve_updates  # noqa: E402
from lightning_lazytrain.schedule.plan_problem import (  # noqa: E402
    head_grad_sum_bytes,
    plan_problem,
    plan_total_bytes,
)
from lightning_lazytrain.sft.plan_model import _named, meta_model  # noqa: E402
from lightning_lazytrain.units import GIB  # noqa: E402

SHAPE, SEQ = "qwen3.6-27b", 1024
# (batch, GPU memory cap in GiB, CPU and NVMe activation budgets in GiB, max_recompute_span): small caps force
# mixes of homes and kept graphs, the larger ones leave room for many kept graphs (a 64-item knapsack), small host
# budgets force recompute (the hard case of milp_solve.py), span 8 doubles the edges; the resident embeddings and
# head of this shape take 15.2 GiB of each cap.
CASES = {"b16-cap40": (16, 40.0, 16.0, 32.0, 4), "b16-cap64": (16, 64.0, 16.0, 32.0, 4),
         "b32-cap80": (32, 80.0, 32.0, 64.0, 4), "b48-cap141": (48, 141.0, 32.0, 64.0, 4),
         "b16-cap40-host2": (16, 40.0, 2.0, 1.0, 4), "b32-cap80-host4": (32, 80.0, 4.0, 2.0, 4),
         "b16-cap40-host2-span8": (16, 40.0, 2.0, 1.0, 8)}
CPU_UPDATE_PARAMS_PER_S = 4.0e9  # HybridAdamW on the 16-core H200 host (optim_cpu_324b44b_cpu16.json)


def problem_for(adapter, batch: int, cap_gib: float, cpu_gib: float, nvme_gib: float, span: int):
    """The planner's problem on a GPU of ``cap_gib``, less the resident embeddings/head three times (the device
    copy, its gradient and the embedding's dense gradient; the strategy counts the copy only) and the margin."""
    profile = analytic_profile(adapter, batch, SEQ, gpu_spec("h200"))
    layout = gpu_layout(adapter)
    total = plan_total_bytes(int(cap_gib * GIB) - 3 * layout.resident_copy_bytes)
    return plan_problem(profile, total, int(cpu_gib * GIB), int(nvme_gib * GIB), total_bytes=total,
                        slot_bytes=layout.slot_bytes, prefetch_depth=2, loss_chunk_bytes=LOSS_CHUNK_BYTES,
                        head_grad_bytes=head_grad_sum_bytes(adapter.lm_head), max_recompute_span=span,
                        keep_graph_layers=0)


def update_problem(adapter, batch: int) -> UpdateProblem:
    """The update split for the 64 layers: HybridAdamW's fp32 master + 2 states in, + the bf16 copy out."""
    profile = analytic_profile(adapter, batch, SEQ, gpu_spec("h200"))
    numel = [b // 2 for b in profile.param_bytes]
    half = profile.duplex_bytes_per_s / 2
    return UpdateProblem(cpu_seconds=[k / CPU_UPDATE_PARAMS_PER_S for k in numel],
                         device_seconds=[max(12 * k / min(profile.h2d_bytes_per_s, half),
                                             14 * k / min(profile.d2h_bytes_per_s, half)) for k in numel],
                         forward_seconds=list(profile.forward_seconds))


def _machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu_model": model, "cores_in_machine": os.cpu_count(), "cores_used": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
            "note": "the 2 cores are shared with other sessions' processes: times are upper estimates"}


def _commit() -> str:
    root = Path(__file__).resolve().parents[1]
    head = subprocess.check_output(["git", "-C", str(root), "rev-parse", "HEAD"], text=True).strip()
    dirty = subprocess.check_output(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    text=True).strip()
    return head + ("-dirty" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--gap", type=float, default=0.01)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="default: benchmarks/results/milp_solve_2core_<commit>_cpu2.json")
    args = ap.parse_args()
    from results_index import result_path  # beside this script

    args.out = args.out or result_path("milp_solve_2core", f"cpu{os.cpu_count()}")
    adapter = adapter_for(meta_model(_named(SHAPE)))
    results = {}
    for name, (batch, cap, cpu, nvme, span) in CASES.items():
        prob = problem_for(adapter, batch, cap, cpu, nvme, span)
        for engine in (False, True):
            key = f"{name}-{'engine' if engine else 'paper'}-windows"
            t0 = time.perf_counter()
            s = solve(prob, time_limit=args.time_limit, mip_gap=args.gap, threads=args.threads,
                      engine_windows=engine)
            wall = time.perf_counter() - t0
            results[key] = {"batch": batch, "gpu_cap_gib": cap, "gpu_total_gib": prob.gpu_total_bytes / GIB,
                            "cpu_gib": cpu, "nvme_gib": nvme, "max_recompute_span": span,
                            "engine_windows": engine, "layers": prob.num_layers,
                            "binaries": s.info["num_binaries"], "solve_seconds": round(wall, 3),
                            "build_seconds": s.info["build_seconds"], "status": s.status, "gap": s.info["mip_gap"],
                            "objective": s.objective, "predicted_exposed_seconds": s.predicted_exposed_seconds,
                            "counts": s.counts(), "kept_graphs": sum(s.keep_graph),
                            "mlp_recompute": sum(s.mlp_recompute)}
            print(f"{key}: {wall:.2f} s {s.status} gap {s.info['mip_gap']:.4f} binaries {s.info['num_binaries']}"
                  f" counts {s.counts()} kept {sum(s.keep_graph)} (mlp re-run {sum(s.mlp_recompute)})", flush=True)
        if f"b{batch}-update-placement" in results:
            continue
        up = update_problem(adapter, batch)
        t0 = time.perf_counter()
        split = solve_updates(up, time_limit=args.time_limit, mip_gap=args.gap, threads=args.threads)
        wall = time.perf_counter() - t0
        results[f"b{batch}-update-placement"] = {
            "batch": batch, "units": len(up.cpu_seconds), "solve_seconds": round(wall, 3), "status": split.status,
            "gap": split.gap, "wait_seconds": split.wait_seconds, "device_units": sum(split.on_device),
            "cpu_update_params_per_s": CPU_UPDATE_PARAMS_PER_S}
        print(f"b{batch}-update-placement: {wall:.2f} s {split.status} gap {split.gap:.4f} wait "
              f"{split.wait_seconds:.3f} s, {sum(split.on_device)} units on the device", flush=True)
    doc = {"command": "taskset -c " + ",".join(map(str, sorted(os.sched_getaffinity(0)))) + " python "
           + " ".join(sys.argv), "commit": _commit(), "machine": _machine(), "shape": SHAPE, "seq": SEQ,
           "time_limit": args.time_limit, "mip_gap": args.gap, "threads": args.threads,
           "torch": torch.__version__, "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
