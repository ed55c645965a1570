#!/usr/bin/env bash
# Issue 5 on the H200: the Qwen2.5-3B recipe end to end with a random-init model (no weights can be downloaded
# there), the shipped demo data packed to seq 1024, a few steps, metrics through the CSV logger.
#   bash benchmarks/recipe_gpu.sh OUTDIR
set -euo pipefail
out=${1:?output dir}
python3 -m lightning_lazytrain.sft.cli fit --config qwen2.5-3b \
  --model.pretrained null --model.model_config qwen2.5-3b --model.dtype bfloat16 \
  --data.data_path demo --data.packing true --data.batch_size 8 --data.max_eval_samples 16 \
  --model.max_generate_samples 8 --model.max_new_tokens 16 \
  --trainer.max_steps 6 --trainer.val_check_interval 6 --trainer.enable_progress_bar false \
  --trainer.logger.init_args.save_dir "$out/runs" \
  --trainer.callbacks '[{"class_path": "lightning_lazytrain.sft.metrics.ThroughputMetrics"}]'
