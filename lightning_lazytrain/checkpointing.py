"""How the strategy saves and restores a run: what a checkpoint holds beyond Lightning's, and where it comes from.

``RunCheckpoints`` is the strategy's part its checkpoint hooks hand off to. Files go through ``AtomicCheckpointIO``
(atomic saves, loads verified against a manifest; docs/reliability.md). A ``last*.ckpt`` that does not verify is
swapped for the newest checkpoint beside it that does. The model and optimizer states are the module's and the
optimizer's own unless the engine holds them in its own layout (rank shards with several processes); the files are
one written by rank 0, or with several processes a directory of rank shards (``checkpoint/sharded.py``). A run
over a frozen base (LoRA) saves only the trainable weights and a fingerprint of the base
(``checkpoint/trainable.py``), checked when the checkpoint is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_lazytrain.checkpoint import sharded as sharded_checkpoint
from lightning_lazytrain.checkpoint import trainable
from lightning_lazytrain.checkpoint.atomic import AtomicCheckpointIO, CorruptCheckpointError
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.parallel import ProcessGroup
from lightning_lazytrain.resume import STATE_KEY, ResumeState, fallback_for_last


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


def with_atomic_default(io: CheckpointIO | None) -> CheckpointIO:
    """``io``, with ``AtomicCheckpointIO`` where Lightning would put its ``TorchCheckpointIO``: none given, or a
    wrapper (``AsyncCheckpointIO``) around none."""
    if io is None:
        return AtomicCheckpointIO()
    if isinstance(io, _WrappingCheckpointIO) and io.checkpoint_io is None:
        io.checkpoint_io = AtomicCheckpointIO()
    return io


class RunCheckpoints:
    """What the strategy's checkpoint hooks put into a checkpoint and take out of it, and where the files go.
    ``resume``: the run state a checkpoint carries beyond Lightning's; ``processes``: the layout's ranks."""

    def __init__(self, resume: ResumeState, processes: ProcessGroup) -> None:
        self.resume, self.processes = resume, processes
        self.loaded_path = "the checkpoint"

    def model_state(self, executor: StreamingExecutor | None, module: pl.LightningModule) -> dict[str, Any]:
        state = executor.model_state() if executor is not None else None
        if state is not None:
            return state
        state = module.state_dict()
        return trainable.trainable_state(state, module) if trainable.has_frozen_base(module) else state

    def save(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any, io: CheckpointIO,
             executor: StreamingExecutor | None, module: pl.LightningModule) -> None:
        checkpoint[STATE_KEY] = self.resume.dump()
        rank = self.processes.global_rank
        if self.processes.distributed:
            assert executor is not None
            meta = sharded_checkpoint.layout_meta(executor.store, executor.adapter.model) if rank == 0 else None
            sharded_checkpoint.save_sharded(checkpoint, filepath, rank, meta)
            return
        if trainable.has_frozen_base(module):
            checkpoint[trainable.BASE_KEY] = trainable.base_fingerprint(module)
        if rank == 0:
            io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove(self, filepath: _PATH, io: CheckpointIO) -> None:
        if self.processes.global_rank != 0:
            return
        if self.processes.distributed and os.path.isdir(filepath):
            sharded_checkpoint.remove_sharded(filepath)
        else:
            io.remove_checkpoint(filepath)

    def load(self, checkpoint_path: _PATH, read: Callable[[_PATH], dict[str, Any]],
             module: pl.LightningModule | None) -> dict[str, Any]:
        """``read``: Lightning's load of one file. A sharded directory is read rank by rank instead."""
        if sharded_checkpoint.is_sharded(checkpoint_path):
            checkpoint = sharded_checkpoint.load_sharded(checkpoint_path, self.processes.global_rank,
                                                         self.processes.world_size)
        else:
            try:
                checkpoint = read(checkpoint_path)
            except CorruptCheckpointError as err:
                # fit(ckpt_path="last") resolved to a last*.ckpt that does not verify: take the newest one that does
                checkpoint_path = fallback_for_last(str(checkpoint_path), err)
                checkpoint = read(checkpoint_path)
        if module is not None and module.trainer.state.fn == TrainerFn.FITTING:
            refuse_weights_only_resume(checkpoint, str(checkpoint_path))
        self.resume.load(checkpoint.get(STATE_KEY))
        self.loaded_path = str(checkpoint_path)
        return checkpoint

    def load_model_state(self, checkpoint: Mapping[str, Any], executor: StreamingExecutor | None,
                         module: pl.LightningModule) -> bool:
        """Load what the engine or the trainable part holds; False: the module's own ``load_state_dict`` loads
        it, whose load hooks (engine/compute/hooks.py) wait for queued updates first and refresh what mirrors the
        masters."""
        if executor is not None and executor.load_model_state(checkpoint["state_dict"]):
            return True
        if trainable.BASE_KEY not in checkpoint:
            return False
        trainable.check_base(checkpoint[trainable.BASE_KEY], module, self.loaded_path)
        trainable.load_trainable_state(module, checkpoint["state_dict"], self.loaded_path)
        return True

    @staticmethod
    def load_optimizer_states(checkpoint: Mapping[str, Any], executor: StreamingExecutor | None,
                              optimizers: list[torch.optim.Optimizer]) -> None:
        states = checkpoint["optimizer_states"]
        if executor is not None:
            executor.wait_updates()  # host masters and states current before the load replaces any of them
        if states and executor is not None and executor.load_optimizer_state(states[0]):
            return
        for optimizer, state in zip(optimizers, states):
            optimizer.load_state_dict(state)
        if executor is not None:
            executor.host_state_loaded(masters=False)
