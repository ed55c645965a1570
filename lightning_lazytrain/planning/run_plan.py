"""The run's plan, owned in one place: the schedule the executor runs, the shape it was solved for, its profile,
the plan settings (as given, then as the OOM ladder lowered them) and the plan half of a checkpoint.

The strategy asks it at setup (`start`), before each training batch (`before_batch`: a ladder state to restore, the
MILP solved for the first batch's shape or taken from the checkpoint, solved again for a larger batch or when the
link drifted, `replan.py`) and, when an out-of-memory error in the first steps reaches the ladder's retry loop
(`oom_ladder.step_with_fallback`), for the next rung's plan (`take_rung`). Nothing else keeps a copy.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Any

import torch

from lightning_lazytrain.engine import Schedule, StreamingExecutor
from lightning_lazytrain.engine.link import measure_link_cuda
from lightning_lazytrain.schedule import Profile
from lightning_lazytrain.schedule.plan_inputs import PlanSettings, budgets
from lightning_lazytrain.units import GIB

from .oom_ladder import LOWERED, OomLadder
from .replan import LinkDrift, batch_shape, covers, grown_shape
from .solve import executor_inputs, initial_plan, measure_profile, solve_plan, write_plan

log = logging.getLogger(__name__)


class RunPlan:
    """``schedule``: the plan the executor runs; ``shape``: the batch shape an MILP plan was solved for (None for
    an interval or JSON plan, and before the first batch); ``profile``: the layer profile that plan was solved from
    (None for a plan read from a checkpoint or made by a rung that did not solve), which a re-plan starts from."""

    def __init__(self, settings: PlanSettings, ladder: OomLadder, link_drift: LinkDrift, num_slots: int | None) -> None:
        self.settings, self.ladder, self.link_drift, self.num_slots = settings, ladder, link_drift, num_slots
        self.schedule: Schedule | None = None
        self.shape: tuple[int, int] | None = None
        self.profile: Profile | None = None
        self._saved: tuple[tuple[int, int], str] | None = None
        self._pending_ladder: dict[str, Any] | None = None

    @property
    def solved(self) -> Schedule | None:
        """The MILP's plan (or the rung that replaced it) the run follows, which checkpoints carry; else None."""
        return self.schedule if self.shape is not None else None

    def predicted_seconds(self) -> dict[str, float]:
        """The MILP plan's predictions for a step, beside the measured ones in the strategy's step stats."""
        plan = self.solved
        if plan is None:
            return {}
        return {"predicted_exposed_s": float(plan.predicted_exposed_seconds),
                "predicted_stall_s": float(plan.predicted_stall_seconds)}

    def start(self, device_type: str, num_layers: int) -> Schedule:
        """The plan a new executor starts on: ``schedule="auto"`` settles here, for the run's device."""
        self.settings = self.settings.on_device(device_type)
        self.schedule, self.shape, self.profile = initial_plan(self.settings, num_layers), None, None
        return self.schedule

    def before_batch(self, batch: Any, executor: StreamingExecutor, step: int, log_dir: str) -> None:
        self._restore_ladder(executor)
        if self.settings.kind() == "milp":
            self._plan_for(batch_shape(batch), executor, step, log_dir)

    def _run(
        self, executor: StreamingExecutor, schedule: Schedule, shape: tuple[int, int] | None, profile: Profile | None
    ) -> None:
        self.schedule, self.shape, self.profile = schedule, shape, profile
        executor.set_plan(schedule, self.num_slots)

    def _plan_for(self, shape: tuple[int, int], executor: StreamingExecutor, step: int, log_dir: str) -> None:
        planned = self.shape
        if planned is not None:
            if covers(planned, shape):
                self._maybe_replan(executor, step, log_dir)
                return
            grown = grown_shape(planned, shape)
            log.warning(
                "lazytrain: batch %d x %d is larger than the %d x %d the plan was solved for: solving it for %d x %d",
                *shape,
                *planned,
                *grown,
            )
            shape = grown
            self.ladder.rearm(step)
        elif (found := self.saved_plan(shape)) is not None:
            shape, saved = found
            self._run(executor, saved, shape, None)
            log.info("lazytrain: running the plan saved in the checkpoint for batch %d x %d", *shape)
            return
        schedule, profile = self._solve(executor, shape)
        self._run(executor, schedule, shape, profile)
        path = write_plan(schedule, log_dir)
        log.info("lazytrain: plan for batch %d x %d written to %s", *shape, path)

    def _solve(
        self, executor: StreamingExecutor, shape: tuple[int, int], profile: Profile | None = None
    ) -> tuple[Schedule, Profile]:
        """The plan budgets from the device memory free now: blocks the allocator still caches from earlier steps
        are not in use, but would count as taken (a mid-run plan would get less than the first one did)."""
        if executor.device.type == "cuda":
            torch.cuda.empty_cache()
        profile = profile or measure_profile(self.settings, executor, shape)
        return solve_plan(executor_inputs(self.settings, executor), profile), profile

    def _maybe_replan(self, executor: StreamingExecutor, step: int, log_dir: str) -> None:
        """At a step boundary: solve again when the link drifted from the profile the plan was solved for."""
        if self.link_drift.probe is None and executor.device.type == "cuda":
            self.link_drift.probe = functools.partial(measure_link_cuda, executor.device)
        drifted = self.link_drift.check(step, self.profile)
        if drifted is None or self.shape is None:
            return
        schedule, profile = self._solve(executor, self.shape, drifted)
        self._run(executor, schedule, self.shape, profile)
        path = write_plan(schedule, log_dir)
        log.warning(
            "lazytrain: re-planned at step %d: %s, predicted exposed %.3f s, written to %s",
            step,
            schedule.counts(),
            schedule.predicted_exposed_seconds,
            path,
        )

    def take_rung(self, executor: StreamingExecutor, failure: BaseException) -> bool:
        """Adopt the next rung's plan (for `oom_ladder.step_with_fallback`); False when no rung changes the plan.
        An MILP rung solves again with a smaller GPU budget, which later rungs and re-plans keep; the micro-batch
        count is kept in the settings too, so that a later re-plan solves for it."""
        lowered: dict[str, Any] = {}
        solved: dict[int, Profile] = {}

        def resolve(fraction: float) -> Schedule:
            assert self.shape is not None
            gib = budgets(executor_inputs(self.settings, executor))[0] * fraction / GIB
            lowered["gpu_activation_gib"] = gib
            settings = replace(self.settings, gpu_activation_gib=gib)
            profile = measure_profile(settings, executor, self.shape)
            schedule = solve_plan(executor_inputs(settings, executor), profile)
            solved[id(schedule)] = profile
            return schedule

        milp = self.settings.kind() == "milp" and self.shape is not None
        assert self.schedule is not None
        plan = self.ladder.next_plan(
            self.schedule, self.settings.spill_dir, resolve if milp else None, failure, executor.batch_rows
        )
        if plan is None:
            return False
        self.settings = replace(self.settings, layer_micro_batches=plan.micro_batches, **lowered)
        self._run(executor, plan, self.shape, solved.get(id(plan)))
        return True

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's ``plan`` (an MILP plan and its shape) and ``oom_ladder`` (after a rung: its plan and
        the settings it lowered) entries."""
        state: dict[str, Any] = {}
        if self.solved is not None and self.shape is not None:
            state["plan"] = {"shape": list(self.shape), "schedule": self.solved.to_json()}
        ladder = self.ladder
        if ladder.plan is not None:
            state["oom_ladder"] = {
                "rung": ladder.rung,
                "taken": list(ladder.taken),
                "plan": ladder.plan.to_json(),
                "settings": {name: getattr(self.settings, name) for name in LOWERED},
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Kept for the first resumed batch (the executor does not exist at load time)."""
        plan = state.get("plan")
        self._saved = (tuple(plan["shape"]), plan["schedule"]) if plan else None
        self._pending_ladder = state.get("oom_ladder")

    def forget_pending(self) -> None:
        self._pending_ladder = None

    def saved_plan(self, shape: tuple[int, int]) -> tuple[tuple[int, int], Schedule] | None:
        """The plan the checkpoint holds and the shape it was solved for, when that shape covers this batch's (rows
        and length at least as large; else the MILP is solved anew)."""
        if self._saved is None:
            return None
        saved, plan = self._saved
        return (saved, Schedule.from_json(plan)) if covers(saved, shape) else None

    def _restore_ladder(self, executor: StreamingExecutor) -> None:
        """Put a resumed run back where the saving run's ladder left it: the settings it lowered (so re-plans keep
        them) and, for a plan that is not the MILP's (whose solved plan the checkpoint carries already), the rung's
        plan. Skipped, with a log line, when the user changed the schedule since."""
        state, self._pending_ladder = self._pending_ladder, None
        if state is None:
            return
        saved = state["settings"]
        plan = Schedule.from_json(state["plan"])
        assert self.schedule is not None
        if saved["schedule"] != self.settings.schedule or plan.num_layers != self.schedule.num_layers:
            log.warning(
                "lazytrain: the checkpoint's OOM fallback plan (for schedule=%r) is not restored: this run "
                "has schedule=%r",
                saved["schedule"],
                self.settings.schedule,
            )
            return
        self.settings = replace(self.settings, **{name: saved[name] for name in LOWERED})
        self.ladder.rung, self.ladder.taken, self.ladder.plan = state["rung"], list(state["taken"]), plan
        if self.settings.kind() != "milp":
            self._run(executor, plan, None, None)
        log.info(
            "lazytrain: resumed on the plan the OOM fallback ladder chose (%s): %s, %d layer micro-batches",
            ", ".join(self.ladder.taken),
            plan.counts(),
            plan.micro_batches,
        )
