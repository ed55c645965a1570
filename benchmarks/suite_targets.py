"""The targets of issue 40 over the rows of one ``suite_gpu.py`` file: each a ratio or a figure naming the rows and
batches it reads, with the GPU peak and the share of the update on the GPU of the rows it compares."""

from __future__ import annotations

CEILINGS = (
    "resident-7b-max",
    "resident-ckpt-7b-max",
    "resident-liger-7b-max",
    "resident-ckpt-liger-7b-max",
    "resident-liger-flce-7b-max",
    "resident-ckpt-liger-flce-7b-max",
)
FSDP = ("fsdp-offload-3b-b8-adamw-default", "fsdp-offload-3b-b8-adamw-fused", "fsdp-offload-3b-b8-adamw-fused-nockpt")
# DeepSpeed with lazytrain's share of the update on the GPU: parameters offloaded, and parameters on the GPU
SAME_SHARE = ("deepspeed-z3-ratio-3b-b8", "deepspeed-z3-gpu-params-ratio-3b-b8")
DEFAULT_3B = "lazytrain-default-3b-b8"


def _ok(rows: dict, name: str) -> dict | None:
    r = rows.get(name)
    return r if r is not None and r.get("status") == "ok" else None


def _fastest(rows: dict, names: tuple[str, ...]) -> str:
    ran = [n for n in names if _ok(rows, n)]
    return max(ran, key=lambda n: rows[n]["model_tflops"]) if ran else names[0]


def _ratio(rows: dict, num: str, den: str, target: float | None, key: str = "model_tflops") -> dict | None:
    a, b = _ok(rows, num), _ok(rows, den)
    if a is None or b is None:
        return None
    value = a[key] / b[key]
    return {
        "value": value,
        "of": f"{num} (batch {a['batch']}) / {den} (batch {b['batch']})",
        "by": key,
        "gpu_peak_gib": [a.get("gpu_peak_gib"), b.get("gpu_peak_gib")],
        "gpu_update_share": [a.get("gpu_update_share"), b.get("gpu_update_share")],
        "target": target,
        "met": None if target is None else value >= target,
    }


def _figure(row: dict | None, target: float, **extra) -> dict | None:
    if row is None:
        return None
    tflops = row["model_tflops"]
    return {"model_tflops": tflops, "batch": row["batch"], "target": target, "met": tflops >= target, **extra}


def targets(rows: dict) -> dict:
    """P1 against the best resident ceiling, P2 as a user gets it against each baseline, P5, the paper's batch."""
    out = {
        "P1 lazytrain 7B 80 GiB vs the best resident ceiling": _ratio(
            rows, "lazytrain-7b-80g-max", _fastest(rows, CEILINGS), 1.0
        ),
        "P2 default vs fair DeepSpeed": _ratio(rows, DEFAULT_3B, "deepspeed-z3-offload-fair-3b-b8", 5.0),
        "P2 default vs the faster FSDP": _ratio(rows, DEFAULT_3B, _fastest(rows, FSDP), 3.0),
        "P2 default vs DeepSpeed with the same GPU share": _ratio(rows, DEFAULT_3B, _fastest(rows, SAME_SHARE), 1.5),
        "lazytrain vs MegaTrain policy (3B b8)": _ratio(
            rows, "lazytrain-3b-b8", "megatrain-interval4-after-backward-3b-b8", None
        ),
    }
    p5 = _ok(rows, "lazytrain-7b-24g-b32")
    if p5:
        stall, predicted = p5.get("stall_s") or 0.0, p5.get("predicted_stall_s")
        out["P5 7B 24 GiB b32 stall"] = {
            "model_tflops": p5["model_tflops"],
            "stall_fraction": stall / p5["step_s"],
            "stall_s": stall,
            "predicted_stall_s": predicted,
            "within_2x": None if not predicted else predicted / 2 <= stall <= 2 * predicted,
        }
    out["P5 7B 24 GiB at the plan's batch"] = _figure(_ok(rows, "lazytrain-7b-24g-auto-max"), 500.0)
    paper = _ok(rows, "lazytrain-7b-80g-b144-expandable")
    out["paper 7B b144"] = _figure(paper, 560.0, vs_paper_199_8=paper["model_tflops"] / 199.8 if paper else None)
    return out
