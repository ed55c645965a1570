"""What ``lora_gpu.py`` prints and records last: issue 38's targets over the rows measured so far, and the short
table."""

from __future__ import annotations

CHECK = "check-lora-parity"


def targets(rows: dict) -> dict:
    """Issue 38's targets, from the rows measured so far (None where a row is missing or failed)."""
    out = {}
    for name, tflops, batch in (("lazytrain-lora-27b", 350.0, 32), ("lazytrain-qlora-72b", 250.0, None)):
        r = rows.get(name) or {}
        if r.get("status") != "ok":
            out[name] = None
            continue
        plan = (r.get("plan") or {}).get("step_s")
        out[name] = {
            "model_tflops": r["model_tflops"],
            "tflops_target": tflops,
            "batch": r["batch"],
            "met": r["model_tflops"] >= tflops and (batch is None or r["batch"] >= batch),
            "plan_step_error": r["step_s"] / plan - 1 if plan else None,
        }
    return out


def print_table(rows: dict) -> None:
    print(
        f"{'row':32} {'batch':>5} {'step s':>7} {'TFLOPS':>7} {'tok/s':>7} {'GPU GiB':>7} {'host GiB':>8}"
        f" {'plan s':>6}  status"
    )
    for r in rows.values():
        if r["row"] == CHECK:
            print(
                f"{r['row']:32} {r.get('status')}  "
                + ", ".join(f"{k} {v['adapter_update_rel_diff']:.1e}" for k, v in r.items() if isinstance(v, dict))
            )
            continue
        plan = (r.get("plan") or {}).get("step_s")
        cells = [f"{r.get('batch', '-'):>5}"]
        for key, spec, width in (
            ("step_s", ".3f", 7),
            ("model_tflops", ".1f", 7),
            ("tokens_per_s", ".0f", 7),
            ("gpu_peak_gib", ".1f", 7),
            ("host_peak_gib", ".1f", 8),
        ):
            value = r.get(key)
            cells.append(f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}")
        cells.append(f"{plan:6.1f}" if plan else f"{'-':>6}")
        print(f"{r['row']:32} {' '.join(cells)}  {str(r.get('status'))[:90]}")
