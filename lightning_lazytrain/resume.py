"""What the strategy adds to a checkpoint so that a resumed run continues exactly, and how ``"last"`` is resolved.

Lightning already saves weights, optimizer and LR scheduler states, loop progress and (for stateful loaders) the
data position. The strategy adds, under ``checkpoint["lazytrain"]``:

* the skipped-step counters (``skipped_steps`` and the non-finite guard's streak), so an abort after three bad steps
  in a row counts across a resume;
* the solved MILP plan and the batch shape it was solved for, so a resume runs the same plan without re-solving
  (for any batch no larger);
* what the OOM fallback ladder changed (its plan and the settings it lowered), so a run resumed past the steps the
  ladder acts in does not start again on the plan that ran out of memory;
* the global random streams (torch CPU and CUDA, Python ``random``, NumPy), restored at the first resumed batch:
  that is the same point in the step where the saving run wrote them, whatever setup consumed in between.
"""

from __future__ import annotations

import os
import random
import re
import warnings
from typing import Any

import numpy as np
import torch

from lightning_lazytrain.checkpoint.atomic import CorruptCheckpointError, find_last_good
from lightning_lazytrain.oom_ladder import OomLadder
from lightning_lazytrain.optim import NonFiniteGuard
from lightning_lazytrain.schedule import Schedule

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


def covers(planned: tuple[int, int], shape: tuple[int, int]) -> bool:
    """Whether a plan solved for ``planned`` (rows, length) serves a batch of ``shape``: its bytes only grow with
    the tokens, so any batch no larger."""
    return shape[0] <= planned[0] and shape[1] <= planned[1]


class ResumeState:
    """The run state that a checkpoint carries beyond Lightning's: written by :meth:`dump`, read by :meth:`load`.

    It owns what it saves: the skipped-step count, the non-finite guard, the OOM ladder and the solved plan with
    its batch shape.
    """

    def __init__(self, oom_ladder: OomLadder) -> None:
        self.skipped_steps = 0
        self.nonfinite_guard = NonFiniteGuard()
        self.oom_ladder = oom_ladder
        self.schedule_result: Schedule | None = None
        self.plan_shape: tuple[int, int] | None = None
        self._pending_rng: dict[str, Any] | None = None
        self._saved_plan: tuple[tuple[int, int], str] | None = None

    def dump(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "skipped_steps": self.skipped_steps,
            "nonfinite_guard": self.nonfinite_guard.state_dict(),
            "rng": rng_states(),
        }
        if self.schedule_result is not None and self.plan_shape is not None:
            state["plan"] = {"shape": list(self.plan_shape), "schedule": self.schedule_result.to_json()}
        ladder = self.oom_ladder.state_dict()
        if ladder is not None:
            state["oom_ladder"] = ladder
        return state

    def load(self, state: dict[str, Any] | None) -> None:
        """Counters now; the random streams and the plan wait for the first batch (:meth:`before_batch`)."""
        if state is None:
            return  # a checkpoint from a plain Lightning run: nothing of ours to restore
        self.skipped_steps = state["skipped_steps"]
        self.nonfinite_guard.load_state_dict(state["nonfinite_guard"])
        self._pending_rng = state["rng"]
        plan = state.get("plan")
        self._saved_plan = (tuple(plan["shape"]), plan["schedule"]) if plan else None
        self.oom_ladder.load_state_dict(state.get("oom_ladder"))

    def before_batch(self) -> None:
        if self._pending_rng is not None:
            set_rng_states(self._pending_rng)
            self._pending_rng = None

    def end_run(self) -> None:
        """Forget what a load left for the first batch (a validate(ckpt_path=...) has none; a later fit must not
        inherit its random streams, or its OOM ladder)."""
        self._pending_rng = None
        self.oom_ladder.forget_pending()

    def saved_plan(self, shape: tuple[int, int]) -> tuple[tuple[int, int], Schedule] | None:
        """The plan the checkpoint holds and the shape it was solved for, when that shape covers this batch's (rows
        and length at least as large; else the MILP is solved anew)."""
        if self._saved_plan is None:
            return None
        saved, plan = self._saved_plan
        return (saved, Schedule.from_json(plan)) if covers(saved, shape) else None
