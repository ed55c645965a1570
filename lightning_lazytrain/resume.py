"""What the strategy adds to a checkpoint so that a resumed run continues exactly, and how ``"last"`` is resolved.

Lightning already saves weights, optimizer and LR scheduler states, loop progress and (for stateful loaders) the
data position. The strategy adds, under ``checkpoint["lazytrain"]``:

* the skipped-step counters (``skipped_steps`` and the non-finite guard's streak), so an abort after three bad steps
  in a row counts across a resume (`ResumeState.engine_step` counts them, and names the checkpoint to resume from
  when the engine's update fails);
* the plan half, from the run's plan (`planning.run_plan.RunPlan.state_dict`): the solved MILP plan and the batch
  shape it was solved for, so a resume runs the same plan without re-solving (for any batch no larger), and what
  the OOM fallback ladder changed (its plan and the settings it lowered), so a run resumed past the steps the
  ladder acts in does not start again on the plan that ran out of memory;
* the global random streams (torch CPU and CUDA, Python ``random``, NumPy), restored at the first resumed batch:
  that is the same point in the step where the saving run wrote them, whatever setup consumed in between.
"""

from __future__ import annotations

import logging
import os
import random
import re
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from lightning_lazytrain.checkpoint.atomic import CorruptCheckpointError, find_last_good
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.optim import NonFiniteGuard
from lightning_lazytrain.planning import RunPlan

log = logging.getLogger(__name__)
STATE_KEY = "lazytrain"
#: the names ``trainer.fit(ckpt_path="last")`` resolves to (ModelCheckpoint's ``last.ckpt``, ``last-v1.ckpt``, ...)
_LAST_NAME = re.compile(r"^last(-v?\d+)?\.ckpt$")


def fallback_for_last(path: str, error: CorruptCheckpointError) -> str:
    """For a ``last*.ckpt`` that failed verification: the newest checkpoint beside it that verifies.

    Any other name was asked for explicitly and is not swapped for another file: ``error`` is raised again.
    """
    if not _LAST_NAME.match(os.path.basename(path)):
        raise error
    directory = os.path.dirname(os.path.abspath(path))
    good = find_last_good(directory)
    if good is None:
        raise CorruptCheckpointError(f"{error}\nNo other checkpoint in {directory} verifies either.") from error
    warnings.warn(f"{path} is corrupt, resuming from {good} instead (the newest checkpoint in {directory} that"
                  " verifies)", stacklevel=2)
    return good


def rng_states() -> dict[str, Any]:
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class ResumeState:
    """The run state that a checkpoint carries beyond Lightning's: written by :meth:`dump`, read by :meth:`load`.

    It owns the skipped-step count, the non-finite guard and the random streams; the plan's entries are the run
    plan's own, which it asks for.
    """

    def __init__(self, run_plan: RunPlan) -> None:
        self.skipped_steps = 0
        self.nonfinite_guard = NonFiniteGuard()
        self.run_plan = run_plan
        self._pending_rng: dict[str, Any] | None = None

    def dump(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "nonfinite_guard": self.nonfinite_guard.state_dict(),
            "rng": rng_states(),
            **self.run_plan.state_dict(),
        }

    def load(self, state: dict[str, Any] | None) -> None:
        """Counters now; the random streams and the plan wait for the first batch (:meth:`before_batch`)."""
        if state is None:
            return  # a checkpoint from a plain Lightning run: nothing of ours to restore
        self.skipped_steps = state["skipped_steps"]
        self.nonfinite_guard.load_state_dict(state["nonfinite_guard"])
        self._pending_rng = state["rng"]
        self.run_plan.load_state_dict(state)

    def before_batch(self) -> None:
        if self._pending_rng is not None:
            set_rng_states(self._pending_rng)
            self._pending_rng = None

    def end_run(self) -> None:
        """Forget what a load left for the first batch (a validate(ckpt_path=...) has none; a later fit must not
        inherit its random streams, or its OOM ladder)."""
        self._pending_rng = None
        self.run_plan.forget_pending()

    def engine_step(self, executor: StreamingExecutor, trainer: pl.Trainer, clip_val: float | None) -> None:
        """The engine's own update; a failure names the last good checkpoint, a non-finite norm skips the step."""
        try:
            stepped = executor.direct_step(clip_val, self.nonfinite_guard, trainer.global_step)
        except RuntimeError as exc:
            reason = str(exc).rstrip(".")
            raise RuntimeError(f"{reason}. Last good checkpoint: {last_checkpoint(trainer)}") from exc
        if not stepped:
            self.skipped_steps += 1
            log.warning("lazytrain: non-finite gradient norm at step %d, step skipped (%d so far)",
                        trainer.global_step, self.skipped_steps)


def last_checkpoint(trainer: pl.Trainer) -> str:
    """The newest checkpoint a ModelCheckpoint callback wrote, for the abort message. Skipped steps leave the
    weights untouched, so a checkpoint written after one still holds the last good weights."""
    paths = [getattr(cb, "last_model_path", "") or getattr(cb, "best_model_path", "")
             for cb in trainer.checkpoint_callbacks]
    paths = [p for p in paths if p]
    return paths[-1] if paths else "none (no ModelCheckpoint has saved yet)"
