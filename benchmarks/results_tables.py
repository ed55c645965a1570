"""The tables ``results_index.py`` writes into README.md and docs/benchmarks.md, from the rows of the current suite
files (``suite_gpu.py``'s), as the files hold them."""

from __future__ import annotations

# the README's rows: (file, row), in the order shown
HEADLINE = [
    ("suite_p1_d16bc1f_h200.json", "lazytrain-7b-80g-max"),
    ("suite_p1_d16bc1f_h200.json", "resident-liger-7b-max"),
    ("suite_p5_paper_16959f6_h200.json", "lazytrain-7b-80g-b144-expandable"),
    ("suite_p5_paper_16959f6_h200.json", "lazytrain-7b-24g-b32"),
    ("suite_auto_16959f6_h200.json", "lazytrain-7b-24g-auto-max"),
    ("suite_micro_d78a9b8_h100.json", "lazytrain-7b-24g-micro4-b96"),
    ("suite_p2_16959f6_h200.json", "lazytrain-gpu-updates-plan-3b-b8"),
    ("suite_p2_16959f6_h200.json", "deepspeed-z3-offload-fair-3b-b8"),
    ("suite_p2_16959f6_h200.json", "fsdp-offload-3b-b8-adamw-fused"),
]
COLUMNS = "| row | model | GPU cap GiB | batch | step s | model TFLOPS | GPU peak GiB | GPU share of the update |"


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _share(row: dict) -> str:
    share = row.get("gpu_update_share")
    return "not recorded" if share is None else f"{share:.2f}"


def row_line(row: dict, file: str | None = None) -> str:
    cap = _num(row.get("gpu_cap_gib"), "g")
    head = f"| `{row.get('row')}` | {row.get('model', '-')} | {cap} | {row.get('batch', '-')}"
    if row.get("status") != "ok":
        tail = f" | {str(row.get('status'))[:100]} | | | |"
    else:
        tail = (
            f" | {row['step_s']:.3f} | {row['model_tflops']:.1f} | {_num(row.get('gpu_peak_gib'), '.1f')}"
            f" | {_share(row)} |"
        )
    return head + tail + (f" {file} |" if file else "")


def _targets(targets: dict) -> list[str]:
    lines = []
    for name, t in (targets or {}).items():
        if not t:
            continue
        if "value" in t:
            met = "" if t.get("met") is None else (", met" if t["met"] else ", missed")
            target = "" if t.get("target") is None else f" (target {t['target']}{met})"
            lines.append(f"- {name}: **{t['value']:.3f}** by {t.get('by')}, {t.get('of')}{target}")
        else:
            shown = ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items() if not isinstance(v, dict)
            )
            lines.append(f"- {name}: {shown}")
    return lines


def headline_table(suites: dict[str, dict]) -> str:
    """The README's table: the HEADLINE rows with their file."""
    lines = [COLUMNS + " file |", "|---|---|---|---|---|---|---|---|---|"]
    for file, name in HEADLINE:
        rows = {r.get("row"): r for r in suites.get(file, {}).get("rows", [])}
        if name in rows:
            machine = suites[file].get("machine") or {}
            lines.append(row_line(rows[name], f"`{file}` ({machine.get('gpu')})"))
    lines += ["", "Ratios as those files record them (the targets of issue 16, at the file's commit):", ""]
    for file in dict.fromkeys(f for f, _ in HEADLINE):
        lines += [line + f" (`{file}`)" for line in _targets(suites.get(file, {}).get("targets"))]
    return "\n".join(lines)


def suite_tables(suites: dict[str, dict]) -> str:
    """docs/benchmarks.md's current figures: every row of every current suite file, and the targets it records."""
    out = []
    for file, data in sorted(suites.items()):
        machine = data.get("machine") or {}
        out += [
            f"### `{file}`",
            "",
            f"Library at {data.get('commit')}; {machine.get('gpu')}, {machine.get('cpus')} cores, torch "
            f"{machine.get('torch')}, liger-kernel {machine.get('liger_kernel')}.",
            "",
            COLUMNS,
            "|---|---|---|---|---|---|---|---|",
        ]
        out += [row_line(r) for r in data.get("rows", [])]
        recorded = _targets(data.get("targets"))
        if recorded:
            out += ["", "Targets as the file records them (the suite's targets at that commit):", "", *recorded]
        out.append("")
    return "\n".join(out).rstrip()
