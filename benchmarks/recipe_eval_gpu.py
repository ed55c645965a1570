"""Issue 14's done-when run on the H200: the 3B recipe trains 50 steps, then validates once with generation.

    LAZYTRAIN_COMMIT=$(git rev-parse --short HEAD) python benchmarks/recipe_eval_gpu.py
    python benchmarks/recipe_eval_gpu.py --tiny      # a CPU dry run of the same command with a tiny model

``lazytrain fit --config qwen2.5-3b`` with CLI overrides only: a random-init Qwen2.5-3B (no weights
can be downloaded there), the shipped MetaMathQA-format demo data packed to seq 1024, batch ``--batch-size``,
``--steps`` steps, then one validation on 128 held-out rows that also generates greedy answers for 128 prompts,
up to 256 new tokens each. :class:`PhaseTimer` (a callback given to the CLI) takes the wall time of the training
steps and of the validation; the module logs ``val/generate_s`` and ``val/generate_tokens_per_s``. Writes
``--out`` with the command, commit, machine, versions and times, and prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import lightning.pytorch as pl
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = dict(model_type="qwen2", vocab_size=151669, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer(pl.Callback):
    """Wall seconds of the training steps (first batch start to the validation's start) and of the validation
    (loss over the held-out rows and the generation); written as JSON to ``path`` when the fit ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.marks: dict[str, float] = {}
        self.steps = 0
        self.step_ends: list[float] = []
        self.validation: dict[str, object] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if "train_start" not in self.marks:
            _sync()
            self.marks["train_start"] = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        self.steps += 1
        if self.steps == 1:
            _sync()
            self.marks["first_step_end"] = time.perf_counter()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync()
        self.marks["val_start"] = time.perf_counter()
        self.validation["after_steps"] = self.steps

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync()
        self.marks["val_end"] = time.perf_counter()
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        plan = getattr(getattr(trainer.strategy, "generation", None), "last_plan", None)
        self.validation.update(metrics=metrics, generation_plan=plan.describe() if plan is not None else None)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        m = self.marks
        payload = {"steps": self.steps, "train_s": m["val_start"] - m["train_start"],
                   "train_s_after_step_1": m["val_start"] - m["first_step_end"],
                   "validation_s": m["val_end"] - m["val_start"], **self.validation}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2)
        os.replace(tmp, self.path)


def _cli_args(args, timer_path: str, run_dir: str) -> list[str]:
    timer = {"class_path": "recipe_eval_gpu.PhaseTimer", "init_args": {"path": timer_path}}
    callbacks = [{"class_path": "lightning_lazytrain.sft.metrics.ThroughputMetrics"}, timer]
    cli = ["fit", "--config", "qwen2.5-3b",
           "--model.pretrained", "null", "--model.dtype", "bfloat16" if not args.tiny else "float32",
           "--model.model_config", json.dumps(TINY_MODEL) if args.tiny else "qwen2.5-3b",
           "--model.max_new_tokens", str(args.new_tokens), "--model.max_generate_samples", str(args.prompts),
           "--data.data_path", "demo", "--data.packing", "true", "--data.batch_size", str(args.batch_size),
           "--data.max_eval_samples", str(args.prompts), "--data.eval_batch_size", "16",
           "--trainer.max_steps", str(args.steps), "--trainer.max_epochs", "-1",
           "--trainer.val_check_interval", str(args.steps),
           "--trainer.check_val_every_n_epoch", "null", "--trainer.num_sanity_val_steps", "0",
           "--trainer.enable_checkpointing", "false", "--trainer.enable_progress_bar", "false",
           "--trainer.logger.init_args.save_dir", run_dir, "--trainer.callbacks", json.dumps(callbacks)]
    if args.tiny:
        cli += ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true", "--data.max_seq_length", "128",
                "--trainer.strategy.init_args.schedule", "interval:1"]
    return cli


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny model, 3 steps, 8 prompts")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/recipe_eval_<commit>_<machine>.json")
    parser.add_argument("--run-dir", default=None, help="logs and metrics.csv (default: a temporary directory)")
    args = parser.parse_args()
    for name, full, tiny in (("steps", 50, 3), ("batch_size", 8, 2), ("prompts", 128, 8), ("new_tokens", 256, 8)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    if args.out is None and not args.tiny:
        from common import default_out  # imported late, as write_results below

        args.out = default_out("recipe_eval")
    out = args.out or os.path.join(tempfile.gettempdir(), "recipe_eval_tiny.json")
    run_dir = args.run_dir or tempfile.mkdtemp(prefix="recipe_eval_")
    timer_path = os.path.join(run_dir, "phases.json")
    cli = _cli_args(args, timer_path, run_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lightning_lazytrain.sft.cli", *cli], env=env)
    wall_s = time.perf_counter() - start
    if done.returncode != 0 or not os.path.exists(timer_path):
        sys.exit(f"the recipe run failed (exit {done.returncode}); its log is above, run dir {run_dir}")
    with open(timer_path) as f:
        phases = json.load(f)
    sys.path.insert(0, HERE)
    from common import write_results

    metrics = phases.get("metrics", {})
    result = {"recipe": "qwen2.5-3b", "cli_overrides": cli[3:], "model": "tiny" if args.tiny else
              "qwen2.5-3b random init", "batch_size": args.batch_size, "prompts": args.prompts,
              "max_new_tokens": args.new_tokens, "wall_s": wall_s, **phases,
              "generate_s": metrics.get("val/generate_s"),
              "decode_tokens_per_s": metrics.get("val/generate_tokens_per_s"),
              "validation_faster_than_training": phases["validation_s"] < phases["train_s"]}
    write_results(out, result)
    print(f"{phases['steps']} steps: {phases['train_s']:.1f} s ({phases['train_s_after_step_1']:.1f} s after step 1);"
          f" validation: {phases['validation_s']:.1f} s, of which generation {result['generate_s'] or 0:.1f} s at"
          f" {result['decode_tokens_per_s'] or 0:.1f} tokens/s; validation faster than training:"
          f" {result['validation_faster_than_training']}; whole command {wall_s:.0f} s -> {out}")
    print(f"generation plan: {phases.get('generation_plan')}")


if __name__ == "__main__":
    main()
