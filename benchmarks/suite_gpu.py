"""The fair baseline suite and the targets of issue 40, one table regenerated at one commit.

    LAZYTRAIN_COMMIT=<commit> python benchmarks/suite_gpu.py --rows p2   # -> results/suite_p2_<commit>_<gpu>.json
    python benchmarks/suite_gpu.py --rows baselines|megatrain|7b|kernels|ceiling|p5 [--out FILE]
    python benchmarks/suite_gpu.py --rows p2 --tiny --out /tmp/suite_cpu.json     # CPU dry run

Every row runs in its own subprocess (no host model, pinned cache or allocator state is shared between systems)
under a per-row timeout, with the same 2 warm-up and 5 timed steps. Rows already in ``--out`` from other groups are
kept (same name: replaced), the file is rewritten after each row, and the ratios of the targets are recomputed over
all rows (``suite_targets.py``), each naming the batches it compares. A ``-ratio`` DeepSpeed row keeps on the GPU
the share of the update that ``--gpu-share`` gives, else the one its ``share_from`` row recorded in the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field

from child_process import add_child_arguments, ran_as_child, run_child, write_json
from suite_targets import targets


@dataclass
class Row:
    name: str
    group: str
    system: str
    shape: str
    batches: tuple[int, ...]  # one batch, or candidates from the largest down: the first that fits is run
    cap_gib: float | None
    timeout_s: int
    env: dict = field(default_factory=dict)
    share_from: str | None = None  # the row whose GPU share of the update a -ratio row takes
    warmup: int = 2
    timed: int = 5

    @property
    def steps(self) -> int:
        """Batches run: the warm-up ones, then one more than the timed intervals (batch start to batch start)."""
        return self.warmup + self.timed + 1


EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
B8 = "qwen2.5-3b", (8,), 80.0
ROWS = [
    # P2 as a user gets it: strategy="lazytrain" with no option, against the offload baselines of the same batch
    Row("lazytrain-default-3b-b8", "p2", "lazytrain-default", *B8, 150),
    Row("deepspeed-z3-offload-fair-3b-b8", "p2", "deepspeed-z3-offload-fair", *B8, 200),
    Row("deepspeed-z3-ratio-3b-b8", "p2", "deepspeed-z3-ratio", *B8, 200, share_from="lazytrain-default-3b-b8"),
    Row("fsdp-offload-3b-b8-adamw-fused", "p2", "fsdp-cpu-offload-fused", *B8, 150),
    # the rest of the like-for-like table: the planned activations, every update on the CPU, parameters on the GPU,
    # and each baseline without activation checkpointing
    Row("lazytrain-3b-b8", "baselines", "lazytrain", *B8, 150),
    Row("lazytrain-cpu-updates-3b-b8", "baselines", "lazytrain-cpu-updates", *B8, 150),
    Row("deepspeed-z3-offload-fair-nockpt-3b-b8", "baselines", "deepspeed-z3-offload-fair-nockpt", *B8, 200),
    Row("deepspeed-z3-gpu-params-3b-b8", "baselines", "deepspeed-z3-gpu-params", *B8, 200),
    Row("deepspeed-z3-gpu-params-nockpt-3b-b8", "baselines", "deepspeed-z3-gpu-params-nockpt", *B8, 200),
    Row("deepspeed-z3-gpu-params-ratio-3b-b8", "baselines", "deepspeed-z3-gpu-params-ratio", *B8, 200,
        share_from="lazytrain-default-3b-b8"),
    Row("fsdp-offload-3b-b8-adamw-fused-nockpt", "baselines", "fsdp-cpu-offload-fused-nockpt", *B8, 150),
    Row("fsdp-offload-3b-b8-adamw-default", "baselines", "fsdp-cpu-offload", *B8, 150),
    Row("megatrain-interval4-after-backward-3b-b8", "megatrain", "lazytrain-interval4", *B8, 200),
    Row("megatrain-interval4-overlapped-3b-b8", "megatrain", "lazytrain-interval4-overlap", *B8, 150),
    # from the largest batch down: batch 96 ran at 385.4 model-TFLOPS where 144 ran at 435.3 on the same H200
    # (suite_p1_c17ab17_h200.json, suite_kernels_c17ab17_h200.json), so the search starts above the paper's batch
    Row("lazytrain-7b-80g-max", "7b", "lazytrain", "qwen2.5-7b", (192, 160, 144, 96, 64), 80.0, 420, EXPANDABLE),
    Row("lazytrain-7b-80g-b144-expandable", "7b", "lazytrain", "qwen2.5-7b", (144,), 80.0, 360, EXPANDABLE),
    Row("lazytrain-hf-kernels-7b-80g-b144-expandable", "kernels", "lazytrain-hf-kernels", "qwen2.5-7b", (144,), 80.0,
        420, EXPANDABLE),
    Row("resident-7b-max", "ceiling", "gpu-resident", "qwen2.5-7b", (24, 16, 12, 8, 4), None, 240),
    Row("resident-ckpt-7b-max", "ceiling", "gpu-resident-ckpt", "qwen2.5-7b", (96, 64, 48, 32, 16), None, 300),
    Row("resident-liger-7b-max", "ceiling", "gpu-resident-liger", "qwen2.5-7b", (24, 16, 12, 8, 4), None, 240),
    Row("resident-ckpt-liger-7b-max", "ceiling", "gpu-resident-ckpt-liger", "qwen2.5-7b", (96, 64, 48, 32, 16), None,
        300),
    # the ceiling with lazytrain's loss and allocator setting: Liger's chunked head loss, expandable segments
    Row("resident-liger-flce-7b-max", "ceiling", "gpu-resident-liger-flce", "qwen2.5-7b", (32, 24, 16, 12, 8), None,
        300, EXPANDABLE),
    Row("resident-ckpt-liger-flce-7b-max", "ceiling", "gpu-resident-ckpt-liger-flce", "qwen2.5-7b",
        (128, 96, 64, 48, 32), None, 360, EXPANDABLE),
    Row("lazytrain-7b-24g-b32", "p5", "lazytrain", "qwen2.5-7b", (32,), 24.0, 420),
    # the 24 GiB cap at three times P5's batch: whole-batch layers, then each layer in four row slices
    Row("lazytrain-7b-24g-b96", "p5", "lazytrain-whole-batch", "qwen2.5-7b", (96,), 24.0, 480),
    Row("lazytrain-7b-24g-micro4-b96", "p5", "lazytrain-micro4", "qwen2.5-7b", (96,), 24.0, 540),
    # the MILP's own choice of slices (layer_micro_batches="auto") at up to twice that batch under the same cap
    Row("lazytrain-7b-24g-auto-max", "p5", "lazytrain", "qwen2.5-7b", (192, 160, 128), 24.0, 600),
]
GROUPS = sorted({r.group for r in ROWS})


def child(spec: dict, out: str) -> None:
    """Runs one row in this process and writes its result to ``out``."""
    from run import FIT_FAILURES, one_run

    tried = []
    for batch in spec["batches"]:
        result = one_run(spec["system"], spec["shape"], batch, spec["cap_gib"], spec["steps"], spec["warmup"], {},
                         gpu_share=spec["gpu_share"])
        if result["status"] == "ok" or not any(k in result["status"] for k in FIT_FAILURES):
            break
        tried.append({"batch": batch, "status": result["status"][:200]})
    engine = result.pop("engine", {}) or {}
    result.update(
        {
            "row": spec["name"],
            "group": spec["group"],
            "refused_batches": tried,
            "env": spec["env"],
            "stall_s": engine.get("stall_s"),
            # the link waits the plan predicts (its unhidden transfers and the step-start weight copy)
            "predicted_stall_s": engine.get("predicted_stall_s"),
            "update_wait_s": engine.get("update_wait_s"),
            "engine": engine,
        }
    )
    write_json(out, result)


def run_row(row: Row, tiny: bool, gpu_share: float | None = None) -> dict:
    """``row`` in a child process; ``tiny``: the tiny shape at batch 2 (4 first where the row searches), the same
    warm-up and timed steps."""
    spec = {**asdict(row), "steps": row.steps, "gpu_share": gpu_share}
    if tiny:
        spec.update(shape="tiny", batches=[4, 2] if len(row.batches) > 1 else [2])
    failed = {"row": row.name, "group": row.group, "system": row.system, "gpu_share_asked": gpu_share}
    if "-ratio" in row.system and gpu_share is None:
        return {**failed, "status": f"not run: no GPU share of the update (--gpu-share, or an ok {row.share_from})"}
    from common import allocator_env

    spec["env"] = {**allocator_env(row.system), **row.env}
    result, failure, wall = run_child(__file__, spec, spec["env"], row.timeout_s)
    if result is None:
        return {**failed, "status": failure, "wall_s": wall}
    return {**result, "gpu_share_asked": gpu_share, "wall_s": wall}


def share_for(row: Row, rows: dict, asked: float | None) -> float | None:
    """The GPU's share of the update a ``-ratio`` row keeps: ``asked`` (``--gpu-share``), else what its
    ``share_from`` row recorded; None for the other rows."""
    if "-ratio" not in row.system:
        return None
    if asked is not None:
        return asked
    source = rows.get(row.share_from) or {}
    return source.get("gpu_update_share") if source.get("status") == "ok" else None


def save(path: str, rows: dict) -> None:
    from common import commit, machine

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(
            {
                "commit": commit(),
                "machine": machine(),
                "seq": 1024,
                "targets": targets(rows),
                "rows": list(rows.values()),
            },
            f,
            indent=2,
            default=str,
        )
    os.replace(tmp, path)


def _share(row: dict) -> str:
    share = row.get("gpu_update_share")
    return "-" if share is None else f"{share:.2f}"


def print_table(rows: dict) -> None:
    print(f"{'row':42} {'batch':>5} {'step s':>7} {'TFLOPS':>7} {'tok/s':>8} {'GPU GiB':>7} {'host GiB':>8}"
          f" {'GPU upd':>7}  kernel")
    for r in rows.values():
        if r.get("status") != "ok":
            print(f"{r['row']:42} {str(r.get('status'))[:80]}")
            continue
        print(
            f"{r['row']:42} {r['batch']:>5} {r['step_s']:7.3f} {r['model_tflops']:7.1f} {r['tokens_per_s']:8.0f}"
            f" {r['gpu_peak_gib']:7.1f} {r['host_peak_gib']:8.1f} {_share(r):>7}  {r.get('kernel_path')}"
        )
    for name, t in targets(rows).items():
        if t is not None:
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", default=["all"], help=f"row names or groups {GROUPS}, or all")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/suite_<rows>_<commit>_<machine>.json (results_index.py)")
    parser.add_argument("--tiny", action="store_true", help="the tiny shape on whatever device: a dry run")
    parser.add_argument("--gpu-share", type=float, default=None,
                        help="the GPU's share of the update for the -ratio rows (default: their share_from row's)")
    add_child_arguments(parser)
    args = parser.parse_args()
    if ran_as_child(args, child):
        return
    if args.out is None and args.tiny:  # a dry run writes nothing into results/
        args.out = os.path.join(tempfile.gettempdir(), "suite_tiny.json")
    if args.out is None:
        from common import default_out

        args.out = default_out("suite_" + "-".join(args.rows))
    picked = [r for r in ROWS if "all" in args.rows or r.name in args.rows or r.group in args.rows]
    unknown = set(args.rows) - {"all", *GROUPS, *(r.name for r in ROWS)}
    if unknown:
        parser.error(f"unknown rows {sorted(unknown)}; choose from groups {GROUPS} or {[r.name for r in ROWS]}")
    rows: dict = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            rows = {r["row"]: r for r in json.load(f)["rows"]}
    for row in picked:
        result = run_row(row, args.tiny, share_for(row, rows, args.gpu_share))
        rows[row.name] = result
        print(json.dumps({k: v for k, v in result.items() if k not in ("engine", "step_s_each")}, default=str),
              flush=True)
        save(args.out, rows)
    print_table(rows)


if __name__ == "__main__":
    main()
