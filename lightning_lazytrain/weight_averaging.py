"""Lightning's weight-averaging callbacks (``WeightAveraging``, ``EMAWeightAveraging``, ``StochasticWeightAveraging``)
under the strategy.

They read and write the module's parameters in place (``param.data.copy_``): the average is updated from them after
an optimizer step, swapped in for validation and back after it, copied over them when training ends. Under the
strategy the masters are written by queued updates (and, for units updated on the device, live there until drained),
and what streams is a copy of them refreshed only when the engine knows they changed. So, without this callback,
the average reads half-updated masters, validation runs the training weights while the metrics claim the average,
and the copies left from validation leak the average into the next training step.

``WeightAveragingSync`` runs before the user's callbacks (the strategy puts it first): it waits for the queued
updates (and drains the device's) wherever an averaging callback is about to read the masters, and marks every
streamed and device copy stale wherever one has just written them.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging

from lightning_lazytrain.engine import StreamingExecutor


def averaging_callbacks(trainer: pl.Trainer) -> list[Callback]:
    return [cb for cb in trainer.callbacks if isinstance(cb, (WeightAveraging, StochasticWeightAveraging))]


class WeightAveragingSync(Callback):
    """Keeps the host masters and what mirrors them coherent around Lightning's weight-averaging callbacks."""

    def __init__(self, executor: StreamingExecutor, averaging: list[Callback]) -> None:
        self.executor = executor
        self.averaging = averaging
        self._swapped = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # an average updated from the masters right after this needs the step just queued to have landed; other
        # steps keep their update hidden behind the next forward
        step_idx = trainer.global_step - 1
        if any(isinstance(cb, WeightAveraging) and cb.should_update(step_idx=step_idx) for cb in self.averaging):
            self.executor.wait_updates()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # an epoch's average is read here, and Lightning calls this also when ``max_steps`` ends training mid-epoch,
        # before the average is copied over the masters at the end: no queued update may land after that copy
        self.executor.wait_updates()

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.executor.wait_updates()  # the swap that follows reads the masters
        self._swapped = True

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._after_swap()  # the averaging callbacks' epoch-start hooks have swapped the average in

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._swapped = True  # swapped back by the averaging callbacks after this hook

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._after_swap()

    def _after_swap(self) -> None:
        """Once after each swap: what streams and any device home are refreshed from the masters it wrote."""
        if self._swapped:
            self._swapped = False
            self.executor.host_state_loaded(masters=True)


def install_weight_averaging_sync(trainer: pl.Trainer, executor: StreamingExecutor) -> WeightAveragingSync | None:
    """Put a ``WeightAveragingSync`` first among the trainer's callbacks when an averaging callback is there."""
    averaging = averaging_callbacks(trainer)
    if not averaging:
        return None
    for cb in trainer.callbacks:
        if isinstance(cb, WeightAveragingSync):
            cb.executor, cb.averaging = executor, averaging
            return cb
    sync = WeightAveragingSync(executor, averaging)
    trainer.callbacks.insert(0, sync)
    return sync
