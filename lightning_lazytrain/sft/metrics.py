"""Throughput and memory metrics per training step, logged through the Trainer's logger.

Conventions (so numbers compare with REFERENCE.md and the papers):

* ``perf/tokens_per_s``: non-padding tokens of the batch / step time; a batch without an ``attention_mask`` (packed
  rows) counts every token, its padding too.
* ``perf/model_tflops``: ``(6 * N + 12 * layers * hidden * seq) * batch * seq / step_time / 1e12`` with ``N`` all
  model parameters (embeddings included) and ``batch * seq`` the padded tokens the model computes on. ``6N`` counts
  forward (2N) and backward (4N) matmuls; the second term is causal-free attention scores + values for fwd+bwd.
  This is the "model FLOPs" convention: recomputation is not counted. A frozen parameter (a LoRA base) counts 4
  instead of 6, since its backward computes no weight gradient (``schedule.analytic.model_flops_per_step``, the
  plan's and the benchmarks' count); a 4-bit base counts its weights' logical elements, not the packed bytes.
* ``perf/executed_tflops``: model TFLOPS times the strategy's ``executed_flops_factor`` (e.g. > 1 when it re-runs
  forwards for recomputation); equal to model TFLOPS when the strategy does not expose one.
* ``perf/mfu``: model TFLOPS / the GPU's dense bf16 peak (`lightning_lazytrain.schedule.gpus`, found by the CUDA
  device name, or ``peak_tflops``); not logged on the CPU or on a GPU the table does not know.
* ``perf/step_s``: wall time between consecutive step ends (includes data loading and the optimizer); the first
  step is timed from its own start. No device synchronisation is forced: the loss readback already waits.
* ``mem/gpu_peak_gib`` (CUDA only, peak since the previous step), ``mem/host_rss_gib``.
* ``engine/<key>``: every numeric entry of the strategy's ``last_step_stats`` dict, e.g. the measured stall.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_lazytrain.schedule.analytic import model_flops_per_step
from lightning_lazytrain.schedule.gpus import spec_for_device

log = logging.getLogger(__name__)
#: shown in the progress bar as well as sent to the loggers
PROGRESS_BAR_KEYS = ("perf/tokens_per_s", "perf/model_tflops", "perf/mfu")


def host_rss_bytes() -> int:
    """Resident set size of this process (psutil when installed, else /proc, else the peak from getrusage)."""
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def model_flops_per_token(num_params: int, num_layers: int, hidden: int, seq_len: int,
                          frozen_params: int = 0) -> float:
    """Training FLOPs per token: ``6N + 12 * layers * hidden * seq`` (the convention of REFERENCE.md), with the
    ``frozen_params`` among the ``N`` counted 4 (no weight gradient)."""
    return model_flops_per_step(num_params, num_layers, hidden, 1, seq_len, frozen_params) / seq_len


def _logical_numel(param: torch.Tensor) -> int:
    """Elements of the weight ``param`` stands for: a bitsandbytes 4-bit parameter holds two per byte, its quant
    state the shape."""
    state = getattr(param, "quant_state", None)
    return math.prod(state.shape) if state is not None else param.numel()


def model_flops_utilization(model_tflops: float, peak_tflops: float) -> float:
    """MFU: the share of the GPU's peak that the model's own FLOPs (recomputation not counted) reach."""
    return model_tflops / peak_tflops


def peak_tflops_of(device: torch.device) -> float | None:
    """The dense bf16 peak of a CUDA device from the published table, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    spec = spec_for_device(torch.cuda.get_device_name(device))
    return spec.bf16_tflops if spec is not None else None


def _find_hf_model(pl_module: pl.LightningModule) -> torch.nn.Module:
    return getattr(pl_module, "model", pl_module)


class ThroughputMetrics(pl.Callback):
    """Logs tokens/s, model and executed TFLOPS, MFU, GPU peak memory, host RSS and the engine's step stats per
    step; tokens/s, model TFLOPS and MFU in the progress bar too.

    Args:
        log_every_n_steps: log one step in this many (metrics are cheap; the logger may not be).
        peak_tflops: the GPU's bf16 peak for MFU, for a GPU the table does not know (default: from the table).
    """

    def __init__(self, log_every_n_steps: int = 1, peak_tflops: float | None = None) -> None:
        self.every = max(1, log_every_n_steps)
        self.peak_tflops = peak_tflops
        self._peak: float | None = None
        self._start: float | None = None
        self._last_end: float | None = None
        self._num_params = 0
        self._layers = 0
        self._hidden = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = _find_hf_model(pl_module)
        # count once: parameters do not change during fit (and a streaming strategy may hide them later)
        self._num_params = sum(_logical_numel(p) for p in model.parameters())
        self._frozen_params = sum(_logical_numel(p) for p in model.parameters() if not p.requires_grad)
        cfg = getattr(model, "config", None)
        text = getattr(cfg, "text_config", None) or cfg
        self._layers = int(getattr(text, "num_hidden_layers", 0) or 0)
        self._hidden = int(getattr(text, "hidden_size", 0) or 0)
        self._last_end = None
        self._peak = self.peak_tflops or peak_tflops_of(pl_module.device)
        if self._peak is None and pl_module.device.type == "cuda":
            log.info("perf/mfu is not logged: %s is not in the GPU table (lightning_lazytrain.schedule.gpus); give"
                     " ThroughputMetrics(peak_tflops=...)", torch.cuda.get_device_name(pl_module.device))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._start = time.perf_counter()
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.perf_counter()
        begin = self._last_end if self._last_end is not None else self._start
        self._last_end = now
        if begin is None or batch_idx % self.every:
            return
        step_s = max(now - begin, 1e-9)
        metrics = self.step_metrics(trainer, pl_module, batch, step_s)
        shown = {k: v for k, v in metrics.items() if k in PROGRESS_BAR_KEYS}
        rest = {k: v for k, v in metrics.items() if k not in PROGRESS_BAR_KEYS}
        pl_module.log_dict(shown, on_step=True, on_epoch=False, batch_size=1, prog_bar=True)
        pl_module.log_dict(rest, on_step=True, on_epoch=False, batch_size=1)

    def step_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                     step_s: float) -> dict[str, float]:
        """The numbers for one step that took ``step_s`` seconds (public so tests and benchmarks can reuse it)."""
        ids = batch["input_ids"] if isinstance(batch, dict) else batch[0]
        b, seq = int(ids.shape[0]), int(ids.shape[-1])
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        real_tokens = int(mask.sum()) if mask is not None else b * seq
        per_token = model_flops_per_token(self._num_params, self._layers, self._hidden, seq, self._frozen_params)
        flops = per_token * b * seq
        model_tflops = flops / step_s / 1e12
        factor = getattr(trainer.strategy, "executed_flops_factor", None)
        factor = factor() if callable(factor) else factor
        out = {
            "perf/step_s": step_s,
            "perf/tokens_per_s": real_tokens / step_s,
            "perf/model_tflops": model_tflops,
            "perf/executed_tflops": model_tflops * float(factor if factor is not None else 1.0),
            "mem/host_rss_gib": host_rss_bytes() / 2**30,
        }
        if self._peak:
            out["perf/mfu"] = model_flops_utilization(model_tflops, self._peak)
        if torch.cuda.is_available() and pl_module.device.type == "cuda":
            out["mem/gpu_peak_gib"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        stats = getattr(trainer.strategy, "last_step_stats", None)
        if isinstance(stats, dict):
            for key, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    out[f"engine/{key}"] = float(value)
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    out[f"engine/{key}"] = float(value.item())
        return out
