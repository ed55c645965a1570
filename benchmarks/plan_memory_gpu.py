"""The plan's GPU bytes against the GPU's, per step and per phase, for one lazytrain run under a memory cap.

    python benchmarks/plan_memory_gpu.py --shape qwen2.5-7b --batch 32 --cap-gib 24 --out results/x.json

The MILP charges a plan its boundaries, kept graphs, slots and a peak (``plan_gpu_pieces``); the executor holds
the resident embedding/norm/head copy beside it. This run lets the out-of-memory ladder act at every step (so a
marginal plan shows where it failed instead of ending the run) and records, per step, the allocated peak of the
forward with the head's loss and of the backward, what was allocated at the step's start, and the rungs taken.
"""

from __future__ import annotations

import argparse
import logging

import lightning.pytorch as pl
import torch
from common import RandomTokens, cap_gpu_memory, write_results
from run import SEQ
from systems import build

import lightning_lazytrain  # noqa: F401

GIB = 2**30


def live_blocks(top: int = 12) -> list[dict]:
    """The largest live allocations, each with the innermost Python frames of this repo or torch that made it
    (needs ``torch.cuda.memory._record_memory_history`` on before they were allocated)."""
    blocks = []
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] != "active_allocated":
                continue
            frames = [f"{f['filename'].split('/site-packages/')[-1].split('/work/main/')[-1]}:{f['line']} {f['name']}"
                      for f in block.get("frames", []) if f["filename"].endswith(".py")]
            ours = [f for f in frames if f.startswith(("lightning_lazytrain", "benchmarks"))]
            blocks.append({"gib": block["size"] / GIB, "frames": frames[:2] + ours[:4]})
    return sorted(blocks, key=lambda b: -b["gib"])[:top]


class PhasePeaks(pl.Callback):
    def __init__(self, live_at_step: int | None = None) -> None:
        self.rows: list[dict] = []
        self.live_at_step = live_at_step
        self.live: list[dict] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.row = {"step": trainer.global_step, "allocated_at_start_gib": torch.cuda.memory_allocated() / GIB}
        if trainer.global_step == self.live_at_step:
            self.live = live_blocks()
        torch.cuda.reset_peak_memory_stats()

    def on_before_backward(self, trainer, module, loss) -> None:
        self.row["forward_and_head_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        torch.cuda.reset_peak_memory_stats()

    def on_after_backward(self, trainer, module) -> None:
        self.row["backward_peak_gib"] = torch.cuda.max_memory_allocated() / GIB

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        strategy = trainer.strategy
        plan = strategy.executor.plan
        self.row.update({"plan": plan.counts(), "kept_graphs": plan.graph_layers,
                         "plan_status": plan.status, "rungs": list(strategy.run_plan.ladder.taken),
                         "modelled_gib": plan.info.get("gpu_bytes", 0) / GIB,
                         "modelled_pieces_gib": {k: v / GIB for k, v in plan.info.get("gpu_pieces", {}).items()},
                         "resident_gib": strategy.executor.resident_device_bytes / GIB})
        self.rows.append(self.row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen2.5-7b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--live-at-step", type=int, default=None,
                    help="at this step's start, record the largest live allocations and the code that made them")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.live_at_step is not None:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    cap_gpu_memory(args.cap_gib)
    run = build("lazytrain", args.shape, args.batch, {})
    run.strategy.run_plan.ladder.steps = args.steps  # the ladder may act at any step of this run
    peaks = PhasePeaks(args.live_at_step)
    data = RandomTokens(args.steps, args.batch, SEQ, run.module.model.config.vocab_size)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=run.strategy, precision=run.precision,
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[peaks], num_sanity_val_steps=0, **run.trainer_kw)
    trainer.fit(run.module, torch.utils.data.DataLoader(data, batch_size=None))
    print(f"{'step':>4} {'start':>7} {'fwd+head':>9} {'backward':>9} {'modelled':>9}  plan, rungs")
    for r in peaks.rows:
        print(f"{r['step']:>4} {r['allocated_at_start_gib']:>7.2f} {r['forward_and_head_peak_gib']:>9.2f} "
              f"{r['backward_peak_gib']:>9.2f} {r['modelled_gib']:>9.2f}  {r['plan']} {r['kept_graphs']} kept, "
              f"{r['rungs']}")
    print("pieces of the last plan (GiB):", peaks.rows[-1]["modelled_pieces_gib"])
    for block in peaks.live:
        print(f"live at step {args.live_at_step}: {block['gib']:.3f} GiB", " <- ".join(block["frames"]))
    write_results(args.out, {"shape": args.shape, "batch": args.batch, "seq": SEQ, "cap_gib": args.cap_gib,
                             "rows": peaks.rows, "live_at_step": args.live_at_step, "live": peaks.live})


if __name__ == "__main__":
    main()
