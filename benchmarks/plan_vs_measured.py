"""`lazytrain plan`'s predictions against the measured lazytrain rows of H200 result files.

Run: ``python benchmarks/plan_vs_measured.py [--measured FILE ...] [--out FILE]
[--extra qwen2.5-7b:80:144 ...]``

For every ``lazytrain`` row (model, GPU cap, batch) of the measured files (`benchmarks/run.py`'s ``runs`` or
`benchmarks/suite_gpu.py`'s ``rows``), and every ``--extra`` point, it forecasts the benchmark's setup
(`benchmarks/systems.py`: HybridAdamW with 8-bit states, bf16-mixed, the MILP plan, seq 1024) on the H200 capped as
the row was, with Liger's kernels where the row's machine had liger-kernel installed (the run binds them then): with
the analytic profile always, and with the profile measured on this GPU when there is one. It writes the JSON and
prints the markdown table docs/plan.md shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_lazytrain.models.adapter import adapter_for  # noqa: E402
from lightning_lazytrain.schedule.analytic import analytic_profile  # noqa: E402
from lightning_lazytrain.schedule.forecast import Machine, RunSpec, forecast  # noqa: E402
from lightning_lazytrain.schedule.gpus import GPUS  # noqa: E402
from lightning_lazytrain.sft.plan_model import meta_model, model_config  # noqa: E402

GIB = 1 << 30
SEQ = 1024
STATE_BYTES = 2.0  # the benchmark's HybridAdamW keeps every large tensor's states in 8 bits
MEASURED = ("h200.json", "suite_p1_d16bc1f_h200.json", "suite_p5_paper_16959f6_h200.json",
            "suite_auto_16959f6_h200.json")
UPDATE_RATE = 4.99e9  # hybrid_frac1_bf16grad_clip_streamcopy on the H200 host's 16 cores (optim_cpu_324b44b_cpu16.json)


def _points(measured: list[dict], extra: list[str]) -> list[tuple[str, float, int, bool, dict | None]]:
    rows = {}
    for results in measured:
        fused = "liger_kernel" in results.get("machine", {})
        for r in results.get("runs", results.get("rows", [])):
            if r.get("system") == "lazytrain" and r.get("status") == "ok":
                rows[(r["model"], float(r["gpu_cap_gib"] or 0), int(r["batch"]), fused)] = r
    for spec in extra:
        model, cap, batch = spec.split(":")
        rows.setdefault((model, float(cap), int(batch), False), None)
    return [(m, c, b, f, r) for (m, c, b, f), r in sorted(rows.items())]


def _forecast(model: str, cap: float, batch: int, fused: bool, measured_profile: bool) -> dict:
    config, _ = model_config(None, model)
    run = RunSpec(adapter_for(meta_model(config)), SEQ, optimizer_state_bytes_per_param=STATE_BYTES, schedule="milp")
    gpu = GPUS["h200"] if not cap else replace(GPUS["h200"], memory_bytes=int(cap * GIB))
    machine = Machine(gpu, 120 * GIB, update_params_per_s=UPDATE_RATE)
    if measured_profile:
        from lightning_lazytrain.schedule.device_profile import measured_profile as measure

        profile_for = lambda b: measure(run.adapter, b, SEQ, torch.device("cuda", 0), fused=fused)  # noqa: E731
    else:
        profile_for = lambda b: analytic_profile(run.adapter, b, SEQ, gpu, fused=fused)  # noqa: E731
    f = forecast(run, machine, batch, profile_for)
    return {
        "fits": f.fits_gpu,
        "step_s": f.prediction.step_s if f.prediction else None,
        "model_tflops": f.model_tflops,
        "gpu_need_gib": f.report.tiers["gpu"].need / GIB,
        "plan": f.schedule.counts() if f.schedule else None,
        "kept_graphs": f.schedule.graph_layers if f.schedule else None,
        "mlp_reruns": sum(f.schedule.mlp_recompute) if f.schedule else None,
        "scaling": f.scaling,
        "notes": f.notes,
    }


def _cell(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", nargs="+", default=[str(ROOT / "benchmarks/results" / name) for name in MEASURED])
    ap.add_argument("--out", default=None, help="default: benchmarks/results/plan_<commit>_cpu<cores>.json")
    ap.add_argument(
        "--extra",
        nargs="*",
        default=["qwen2.5-3b:80:192"],
        help="model:cap_gib:batch points without a measured row (the LazyTrain paper's 3B batch)",
    )
    args = ap.parse_args()
    from results_index import result_path  # beside this script

    args.out = args.out or str(ROOT / result_path("plan", f"cpu{os.cpu_count()}"))
    measured = [json.loads(Path(path).read_text()) for path in args.measured]
    cuda = torch.cuda.is_available()
    rows = []
    for model, cap, batch, fused, m in _points(measured, args.extra):
        row = {
            "model": model,
            "cap_gib": cap,
            "batch": batch,
            "kernels": "liger" if fused else "hf",
            "measured": None
            if m is None
            else {
                "step_s": m["step_s"],
                "model_tflops": m["model_tflops"],
                "gpu_peak_gib": m["gpu_peak_gib"],
                "plan": m.get("plan"),
                "commit": m.get("commit"),
            },
            "analytic": _forecast(model, cap, batch, fused, False),
            "measured_profile": _forecast(model, cap, batch, fused, True) if cuda else None,
        }
        rows.append(row)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = {"commit": commit, "command": " ".join(sys.argv),
           "measured": [str(Path(p).resolve().relative_to(ROOT)) for p in args.measured],
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "rows": rows}
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(args.out)
    print(
        "| model | cap GiB | batch | kernels | measured step s / TFLOPS / GPU GiB (commit) | analytic step s / TFLOPS "
        "/ GPU GiB | measured-profile step s / TFLOPS | plan (gpu/cpu/nvme/recompute) | graphs kept (MLP re-run) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m, a, p = r["measured"] or {}, r["analytic"], r["measured_profile"] or {}
        shown = p if p.get("plan") else a
        plan = shown["plan"] or {}
        print(
            f"| {r['model']} | {r['cap_gib']:g} | {r['batch']} | {r['kernels']} | {_cell(m.get('step_s'), '.2f')} / "
            f"{_cell(m.get('model_tflops'), '.1f')} / {_cell(m.get('gpu_peak_gib'), '.1f')} "
            f"({m.get('commit') or '–'}) | "
            f"{_cell(a['step_s'], '.2f')} / {a['model_tflops']:.1f} / {a['gpu_need_gib']:.1f} | "
            f"{_cell(p.get('step_s'), '.2f')} / {_cell(p.get('model_tflops'), '.1f')} | "
            f"{'/'.join(str(plan.get(t, 0)) for t in ('gpu', 'cpu', 'nvme', 'recompute'))} | "
            f"{_cell(shown['kept_graphs'], 'd')} ({_cell(shown['mlp_reruns'], 'd')}) |"
        )


if __name__ == "__main__":
    main()
