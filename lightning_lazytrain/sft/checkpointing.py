"""``ResumableModelCheckpoint``: the GPU recipes' checkpoints, checked against the disk before the first save.

A 7B full-state checkpoint (fp32 masters + Adam states) is about 90 GB. Lightning finds out that the disk is too
small when a save fails, hours into a run; this callback finds out at fit start, from the same size arithmetic
``lazytrain plan`` uses (`lightning_lazytrain.schedule.disk`), and says which setting to change.

Saves go through ``trainer.save_checkpoint`` -> the strategy -> its ``AtomicCheckpointIO`` (temporary name, fsync,
rename, sha256 manifest), so a kill during a save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import math
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_lazytrain.schedule.checkpoint_modes import checkpoint_modes, fitting_modes_text
from lightning_lazytrain.schedule.disk import checkpoint_bytes, checkpoint_tier, checkpoints_kept, free_bytes

GB = 1e9
#: optimizer state bytes per parameter assumed when the optimizer has made none yet (torch's AdamW makes its two
#: fp32 moments at the first step)
UNMADE_STATE_BYTES_PER_PARAM = 8.0


class CheckpointDiskError(MisconfigurationException):
    """The checkpoints a run will keep do not fit the free space where they are written."""


def optimizer_state_bytes(optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the optimizers' state tensors now (HybridAdamW's own count when it has one: its 8-bit codes)."""
    total = 0
    for opt in optimizers:
        measure = getattr(opt, "state_bytes", None)
        if callable(measure):
            total += int(measure())
            continue
        for state in opt.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def saved_params(pl_module: pl.LightningModule) -> int:
    """Parameters a checkpoint holds: the trainable ones (a frozen base is left out, ``checkpoint/trainable.py``)."""
    return sum(p.numel() for p in pl_module.parameters() if p.requires_grad)


class ResumableModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments), plus:

    * at fit start, before the first save, the checkpoints it will keep (``save_top_k``, a ``last.ckpt`` copy,
      and one more while a save is written) are sized, masters plus optimizer states or masters alone under
      ``save_weights_only``, and compared with the free space at ``dirpath``. Files it already manages there (a
      resumed run's) count as free: its saves replace them. Not enough: :class:`CheckpointDiskError`, naming the
      directory, the sizes and what to change;
    * filenames never contain a folder: every '/' becomes '_' (``{val/loss}`` with ``auto_insert_metric_name``
      would write ``epoch=0-val/loss=1.23.ckpt``, a file in a new directory ``epoch=0-val``). Folders go in
      ``dirpath``.

    ``fit(ckpt_path="last")`` (``lazytrain fit ... --ckpt_path last``) resumes from ``dirpath``'s ``last.ckpt``:
    give the recipe a fixed ``dirpath``, or every run looks in its own new logger version directory.
    """

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if self.save_top_k != 0 or self.save_last:
            self.check_disk(trainer, pl_module)

    def state_bytes_per_param(self, trainer: pl.Trainer, num_params: int) -> float:
        """Optimizer state bytes per parameter one save holds: none under ``save_weights_only``."""
        if self.save_weights_only:
            return 0.0
        made = optimizer_state_bytes(trainer.optimizers)
        return made / num_params if made else UNMADE_STATE_BYTES_PER_PARAM

    def checkpoint_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Estimated bytes of one checkpoint this callback saves (what :meth:`check_disk` multiplies)."""
        num_params = saved_params(pl_module)
        return checkpoint_bytes(num_params, str(trainer.precision), self.state_bytes_per_param(trainer, num_params))

    def check_disk(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raise :class:`CheckpointDiskError` when the checkpoints this run keeps exceed the free disk."""
        num_params = saved_params(pl_module)
        state = self.state_bytes_per_param(trainer, num_params)
        precision = str(trainer.precision)
        saves = self._saves(trainer)
        if saves is None:
            kept = checkpoints_kept(self.save_top_k, self.save_last)
        else:  # a short run keeps only the saves it makes (none: last.ckpt is a file, not a link)
            kept = checkpoints_kept(saves if self.save_top_k == -1 else min(self.save_top_k, saves), self.save_last)
        if not kept:
            return
        directory = os.fspath(self.dirpath or trainer.default_root_dir)
        reclaimed = self._own_files_bytes()
        tier = checkpoint_tier(num_params, precision, state, kept, free_bytes(directory) + reclaimed)
        if not tier.short:
            return
        one = checkpoint_bytes(num_params, precision, state)
        weights = checkpoint_bytes(num_params, precision, 0.0)
        kind = "weights-only" if self.save_weights_only else "full-state"
        master = 2 if precision == "bf16-true" else 4
        what = f"{num_params / 1e9:.2f} B params x ({master} B masters + {state:.2f} B optimizer states)"
        fixes = [f"dirpath (a disk with {tier.need / GB:.1f} GB free)"]
        if kept > 1:
            fixes.append(f"save_top_k (now {self.save_top_k}; each one kept is {one / GB:.1f} GB)")
        if self.save_last is True and self.save_top_k != 0:
            fixes.append("save_last: link (last.ckpt a symlink to the newest checkpoint, not a copy)")
        if not self.save_weights_only:
            fixes.append(f"save_weights_only: true ({weights / GB:.1f} GB each, but no optimizer states: not"
                         " resumable exactly)")
        freed = f" (counting {reclaimed / GB:.1f} GB of this run's checkpoints there)" if reclaimed else ""
        modes = fitting_modes_text(checkpoint_modes(num_params, precision, state, kept, tier.have), kept)
        raise CheckpointDiskError(
            f"the checkpoints do not fit the disk at {directory}: {kept + 1} {kind} checkpoints ({kept} kept, 1 being"
            f" saved) of {one / GB:.1f} GB each [{what}] need {tier.need / GB:.1f} GB, {tier.have / GB:.1f} GB is"
            f" free{freed}. Change in the {type(self).__name__} callback: {'; or '.join(fixes)}. {modes}."
        )

    def _saves(self, trainer: pl.Trainer) -> int | None:
        """How many top-k saves the run makes, when that is known."""
        if self._every_n_train_steps:
            total = trainer.estimated_stepping_batches
            return int(total // self._every_n_train_steps) if math.isfinite(total) else None
        if self._every_n_epochs and trainer.max_epochs is not None and trainer.max_epochs >= 0:
            return trainer.max_epochs // self._every_n_epochs
        return None

    def _own_files_bytes(self) -> int:
        """Bytes of the checkpoint files this callback manages now (restored from a resumed run's state)."""
        paths = {os.path.realpath(p) for p in [*self.best_k_models, self.last_model_path] if p}
        return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))

    def _format_checkpoint_name(self, filename: str | None, metrics: dict[str, torch.Tensor],
                                prefix: str | None = None, auto_insert_metric_name: bool = True) -> str:
        name = super()._format_checkpoint_name(filename, metrics, prefix, auto_insert_metric_name)
        return name.replace("/", "_")
