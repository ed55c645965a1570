"""Callbacks that a subprocess run of ``lazytrain`` loads by class path (``PYTHONPATH=tests``) to fail on purpose."""

import lightning.pytorch as pl


class FailAtStep(pl.Callback):
    """Raise ``RuntimeError`` when training step ``step`` (0-based) starts: a run that fails half way."""

    def __init__(self, step: int = 0) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")
