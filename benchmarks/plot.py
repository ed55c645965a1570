"""Model-TFLOPS per system and model from a suite results file, with the papers' H800 figures beside ours.

    python benchmarks/plot.py benchmarks/results/archive/h200.json docs/benchmarks_tflops.png

Needs the ``plot`` extra (matplotlib). Runs that did not finish are left out of the bars.
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The papers' published single runs on an H800 80 GB (REFERENCE.md): theirs, not measured here.
PAPERS = {
    "LazyTrain paper (H800)": {"qwen2.5-3b": 176.42, "qwen2.5-7b": 199.84, "qwen2.5-14b": 212.34},
    "MegaTrain (H800, per LazyTrain paper)": {"qwen2.5-3b": 142.80, "qwen2.5-7b": 161.35, "qwen2.5-14b": 171.92},
}


def label(run: dict) -> str:
    cap = "no cap" if run["gpu_cap_gib"] is None else f"{run['gpu_cap_gib']:.0f} GiB"
    return f"{run['system']} ({cap}, bs {run['batch']})"


def main(results: str, out: str) -> None:
    with open(results) as f:
        runs = [r for r in json.load(f)["runs"] if r["status"] == "ok"]
    models = sorted({r["model"] for r in runs}, key=lambda m: float(m.split("-")[1].rstrip("b")))
    bars = [(label(r), r["model"], r["model_tflops"], False) for r in runs]
    bars += [(name, m, v, True) for name, by_model in PAPERS.items() for m, v in by_model.items() if m in models]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [b for b in bars if b[1] == model]
        names = [b[0] for b in mine]
        ax.barh(names, [b[2] for b in mine], color=["#bbbbbb" if b[3] else "#3b6fb6" for b in mine])
        for patch, b in zip(ax.patches, mine):
            if b[3]:
                patch.set_hatch("//")
            ax.text(patch.get_width() + 3, patch.get_y() + patch.get_height() / 2, f"{b[2]:.0f}", va="center",
                    fontsize=8)
        ax.set_title(f"{model}, seq 1024")
        ax.set_xlabel("model TFLOPS (6N + attention) per step")
        ax.invert_yaxis()
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle("H200 (ours, blue) vs the papers' H800 figures (grey, hatched: theirs)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
