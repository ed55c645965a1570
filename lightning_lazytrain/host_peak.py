"""The host memory a run really holds: its resident set sampled through the run, the peak of each phase.

Admission's host table (``admission/``) and ``lazytrain plan`` are arithmetic; this callback measures what they
predict. A thread reads the process's resident set size (RSS: every page in RAM, pageable or page-locked alike,
since pinned and ``cudaHostRegister``-ed pages are resident) every ``interval_s`` and keeps the peak of the phase
the run is in: ``"load"`` (from the callback's creation, so build it before the model, to the start of fit),
``"setup"`` (fit start to the first batch: the store, the gradient buffers, admission), ``"first steps"`` (the
first ``first_steps`` training batches), ``"training"`` (the rest), ``"checkpoint save"`` and ``"validation"``.
``peaks`` maps each phase to its peak in bytes; ``peak_bytes`` is the run's; ``baseline_bytes`` is the RSS when the
callback was made (the interpreter and its libraries), which the run's own pieces add to. Off Linux the RSS comes
from psutil the same way.
"""

from __future__ import annotations

import threading
from typing import Any

import lightning.pytorch as pl
import psutil


class HostPeakMemory(pl.Callback):
    def __init__(self, interval_s: float = 0.005, first_steps: int = 3) -> None:
        self.interval_s, self.first_steps = interval_s, first_steps
        self._process = psutil.Process()
        self.baseline_bytes = self._process.memory_info().rss
        self.peaks: dict[str, int] = {}
        self._phase, self._before = "load", "load"
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="lazytrain-host-peak", daemon=True)
        self._thread.start()

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return max(self.peaks.values(), default=0)

    def sample(self) -> None:
        """Record the RSS now in the current phase (the thread does this every ``interval_s``)."""
        rss = self._process.memory_info().rss
        with self._lock:
            self.peaks[self._phase] = max(self.peaks.get(self._phase, 0), rss)

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _enter(self, phase: str) -> None:
        self.sample()  # the last sample of the phase before, so a short phase still has one
        with self._lock:
            self._phase = phase
        self.sample()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter("setup")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._phase == "load":
            self._enter("setup")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._enter("first steps" if trainer.global_step < self.first_steps else "training")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # called as the checkpoint is assembled; the file is written after it, and the phase lasts until the next
        # batch starts (Lightning runs ModelCheckpoint after every other callback's batch end)
        self._enter("checkpoint save")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._before = self._phase
        self._enter("validation")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._enter(self._before)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.close()

    def close(self) -> None:
        """Stop sampling (at the end of fit; again is harmless)."""
        self.sample()
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
