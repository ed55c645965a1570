"""The progress bar the ``lazytrain`` CLI installs: Lightning's rich bar with a true epoch total.

Lightning's ``RichProgressBar`` titles the train bar ``Epoch {e}/{max_epochs - 1}``. A run bounded by ``max_steps``
alone has ``max_epochs == -1`` there, so the demo showed ``Epoch 2/-2``. This bar counts the epochs that
``max_steps`` will reach instead, and shows no total when none is known (an endless loader, no bound at all).
"""

from __future__ import annotations

import math

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


class MaxStepsProgressBar(RichProgressBar):
    """``RichProgressBar`` whose train description is ``Epoch e/last`` with ``last`` from :func:`last_epoch_index`."""

    def _get_train_description(self, current_epoch: int) -> str:
        trainer = self.trainer
        last = last_epoch_index(trainer.max_epochs, trainer.max_steps, trainer.num_training_batches,
                                trainer.accumulate_grad_batches)
        description = f"Epoch {current_epoch}" if last is None else f"Epoch {current_epoch}/{last}"
        # as Lightning does: pad to the validation bar's width so the line does not flicker between the two
        return f"{description:{len(self.validation_description)}}"
