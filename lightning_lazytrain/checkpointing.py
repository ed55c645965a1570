"""How the strategy saves and restores a run: what a checkpoint holds beyond Lightning's, and where it comes from.

Files go through ``AtomicCheckpointIO`` (atomic saves, loads verified against a manifest; docs/reliability.md).
A ``last*.ckpt`` that does not verify is swapped for the newest checkpoint beside it that does. The model and
optimizer states are the module's and the optimizer's own unless the engine holds them in its own layout (rank
shards with several processes); the file layout (one file or a directory of shards) is the parallel layer's.
A run over a frozen base (LoRA) saves only the trainable weights and a fingerprint of the base
(``checkpoint/trainable.py``), checked when the checkpoint is loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

from lightning_lazytrain.checkpoint import sharded as sharded_checkpoint
from lightning_lazytrain.checkpoint import trainable
from lightning_lazytrain.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError
from lightning_lazytrain.parallel import ProcessGroupStrategy
from lightning_lazytrain.resume import STATE_KEY, ResumeState, fallback_for_last

log = logging.getLogger(__name__)


class WeightsOnlyResumeError(MisconfigurationException):
    """``fit(ckpt_path=...)`` names a weights-only checkpoint, which cannot continue a run."""


def refuse_weights_only_resume(checkpoint: Mapping[str, Any], path: str) -> None:
    """Raise :class:`WeightsOnlyResumeError` for a checkpoint without optimizer states.

    Lightning's ``ckpt_path`` restores the whole training state and fails later with a bare ``KeyError`` on such a
    file. Refused, not loaded with a fresh optimizer: the file has no LR-scheduler state either, so its warmup
    would restart at step ``global_step`` and Adam's moments at zero, a different run from the one resumed.
    """
    if "optimizer_states" in checkpoint:
        return
    target = os.path.realpath(path)
    named = f"{path} (a link to {target})" if target != os.path.abspath(path) else path
    raise WeightsOnlyResumeError(
        f"{named} is a weights-only checkpoint (saved with ModelCheckpoint(save_weights_only=True)): it has no"
        " optimizer or LR-scheduler state, so fit cannot resume from it. To resume, save full-state checkpoints"
        " (save_weights_only: false) and pass one of those as ckpt_path; to evaluate these weights, use validate or"
        " test with this ckpt_path; to train on from them as a new run, load them into the model"
        " (LightningModule.load_from_checkpoint, or model.load_state_dict of its 'state_dict') and fit without"
        " ckpt_path."
    )


class CheckpointingStrategy(ProcessGroupStrategy):
    """The checkpoint hooks of ``LazyTrainStrategy``, which builds ``executor`` and ``resume``."""

    resume: ResumeState

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO) and self._checkpoint_io.checkpoint_io is None:
            self._checkpoint_io.checkpoint_io = AtomicCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = self.executor.model_state() if self.executor is not None else None
        if state is not None:
            return state
        state = super().lightning_module_state_dict()
        if trainable.has_frozen_base(self.lightning_module):
            return trainable.trainable_state(state, self.lightning_module)
        return state

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        state = self.executor.optimizer_state() if self.executor is not None else None
        return state if state is not None else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any = None) -> None:
        checkpoint[STATE_KEY] = self.resume.dump()
        if not self.distributed and trainable.has_frozen_base(self.lightning_module):
            checkpoint[trainable.BASE_KEY] = trainable.base_fingerprint(self.lightning_module)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        if sharded_checkpoint.is_sharded(checkpoint_path):
            checkpoint = sharded_checkpoint.load_sharded(checkpoint_path, self.global_rank, self.world_size)
        else:
            try:
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
            except CorruptCheckpointError as err:
                # fit(ckpt_path="last") resolved to a last*.ckpt that does not verify: take the newest one that does
                checkpoint_path = fallback_for_last(str(checkpoint_path), err)
                checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            refuse_weights_only_resume(checkpoint, str(checkpoint_path))
        self.resume.load(checkpoint.get(STATE_KEY))
        self._loaded_path = str(checkpoint_path)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self.executor is not None and self.executor.load_model_state(checkpoint["state_dict"]):
            return
        if trainable.BASE_KEY in checkpoint:
            path = getattr(self, "_loaded_path", "the checkpoint")
            trainable.check_base(checkpoint[trainable.BASE_KEY], self.lightning_module, path)
            trainable.load_trainable_state(self.lightning_module, checkpoint["state_dict"], path)
            return
        # the model's load hooks (engine/hooks.py) wait for queued updates first and refresh what mirrors the masters
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if self.executor is not None:
            self.executor.wait_updates()  # host masters and states current before the load replaces any of them
        if states and self.executor is not None and self.executor.load_optimizer_state(states[0]):
            return
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)
        if self.executor is not None:
            self.executor.host_state_loaded(masters=False)

    def _engine_step(self, clip_val: float | None) -> None:
        """The engine's own update; a failure names the last good checkpoint, a non-finite norm skips the step."""
        trainer = self.lightning_module.trainer
        assert self.executor is not None
        try:
            stepped = self.executor.direct_step(clip_val, self.resume.nonfinite_guard, trainer.global_step)
        except RuntimeError as exc:
            reason = str(exc).rstrip(".")
            raise RuntimeError(f"{reason}. Last good checkpoint: {last_checkpoint(trainer)}") from exc
        if not stepped:
            self.resume.skipped_steps += 1
            log.warning("lazytrain: non-finite gradient norm at step %d, step skipped (%d so far)",
                        trainer.global_step, self.resume.skipped_steps)


def last_checkpoint(trainer: pl.Trainer) -> str:
    """The newest checkpoint a ModelCheckpoint callback wrote, for the abort message. Skipped steps leave the
    weights untouched, so a checkpoint written after one still holds the last good weights."""
    paths = [getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
             for cb in trainer.checkpoint_callbacks]
    paths = [p for p in paths if p]
    return paths[-1] if paths else "none (no ModelCheckpoint has saved yet)"
