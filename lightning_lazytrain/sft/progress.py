"""The progress bar the ``lazytrain`` CLI installs: Lightning's rich bar with a true epoch total and batch total.

Lightning's ``RichProgressBar`` titles the train bar ``Epoch {e}/{max_epochs - 1}``. A run bounded by ``max_steps``
alone has ``max_epochs == -1`` there, so the demo showed ``Epoch 2/-2``. This bar counts the epochs that
``max_steps`` will reach instead, and shows no total when none is known (an endless loader, no bound at all).

The bar counts the epoch's batches from its first (``batch_idx + 1``), but Lightning's total is the steps left from
where the bar is made, which after a resume mid-epoch is the resumed batch: a run resumed at step 4 of 5 read
``5/1``. This bar's total is the batch the epoch will end at, counted from its start, and gradient accumulation is
counted in (Lightning compares optimizer steps with batches).
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar


def last_epoch_index(max_epochs: int | None, max_steps: int, batches_per_epoch: float,
                     accumulate_grad_batches: int = 1) -> int | None:
    """The 0-based index of the last epoch the run will start, or ``None`` when it is not bounded or not known.

    ``max_steps`` counts optimizer steps, each ``accumulate_grad_batches`` batches; ``max_epochs`` of ``None`` or
    a negative number means no epoch bound, ``max_steps`` of -1 no step bound (Lightning's conventions).
    """
    bounds = []
    if max_epochs is not None and max_epochs >= 0:
        bounds.append(max_epochs - 1)
    if max_steps >= 0 and 0 < batches_per_epoch < math.inf:
        bounds.append(max(0, math.ceil(max_steps * accumulate_grad_batches / batches_per_epoch) - 1))
    return min(bounds) if bounds else None


def epoch_batch_total(batches_done: int, num_training_batches: float, max_steps: int, global_step: int,
                      accumulate_grad_batches: int = 1) -> float:
    """The number of batches this epoch ends after, counted from its start: all of them, or fewer where
    ``max_steps`` stops the run first. ``batches_done`` is how many of the epoch's batches have run, ``global_step``
    the optimizer steps taken so far (batches waiting in an unfinished accumulation have not stepped yet)."""
    if max_steps < 0:
        return num_training_batches
    waiting = batches_done % accumulate_grad_batches
    left = max(0, max_steps - global_step) * accumulate_grad_batches - waiting
    return min(num_training_batches, batches_done + left)


class MaxStepsProgressBar(RichProgressBar):
    """``RichProgressBar`` whose train description is ``Epoch e/last`` with ``last`` from :func:`last_epoch_index`,
    and whose train total is :func:`epoch_batch_total`."""

    @property
    def total_train_batches(self) -> int | float:
        """At an epoch's start (no batch run yet)."""
        trainer = self.trainer
        return epoch_batch_total(0, trainer.num_training_batches, trainer.max_steps, trainer.global_step,
                                 trainer.accumulate_grad_batches)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: object,
                           batch: object, batch_idx: int) -> None:
        # a run resumed mid-epoch starts no epoch: its bar is made here, at the resumed batch
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        if self.progress is not None and self.train_progress_bar_id is not None:
            total = epoch_batch_total(batch_idx + 1, trainer.num_training_batches, trainer.max_steps,
                                      trainer.global_step, trainer.accumulate_grad_batches)
            self.progress.update(self.train_progress_bar_id, total=total)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        last = last_epoch_index(trainer.max_epochs, trainer.max_steps, trainer.num_training_batches,
                                trainer.accumulate_grad_batches)
        description = f"Epoch {current_epoch}" if last is None else f"Epoch {current_epoch}/{last}"
        # as Lightning does: pad to the validation bar's width so the line does not flicker between the two
        return f"{description:{len(self.validation_description)}}"
