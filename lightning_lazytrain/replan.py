"""The MILP plan during a run: solved at the first training batch, solved again for a larger batch, and when the
link drifts.

``MilpPlan.before_batch`` solves it for the first batch's shape (or takes the plan the checkpoint holds for a shape
that covers it), writes it beside the logs and hands it to the executor. Batches padded to their longest sample
change shape from step to step, and a plan's memory grows with the tokens: a batch with more rows or columns than
the plan was solved for would run past the device memory the plan counted (after the first steps, the OOM ladder
no longer catches it). Such a batch is planned for first, at its rows and its length rounded up to ``SEQ_STEP``
(so a run meets a new plan a few times, not at every longer batch); smaller batches keep the larger plan.

Online re-plan (``LinkDrift``): every ``every`` steps the link is probed again; when a direction drifted from the
profile the plan was solved for by more than ``tolerance`` (another process on the PCIe link, a throttled GPU), the
MILP is solved again at that step boundary with the measured figures, and the change is logged.

``probe`` returns (h2d, d2h, both-at-once) bytes/s; on CUDA it is `engine.link.measure_link_cuda` (256 MiB pinned
copies, tens of milliseconds), elsewhere there is no link and no probe unless one is injected (the tests' slow
link). Per-layer compute times are not re-measured here: only the link.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch

from lightning_lazytrain.engine import Schedule, StreamingExecutor
from lightning_lazytrain.engine.link import measure_link_cuda
from lightning_lazytrain.planner import PlanSettings, solve_plan, write_plan
from lightning_lazytrain.resume import ResumeState, covers
from lightning_lazytrain.schedule import Profile

log = logging.getLogger(__name__)
GB = 1e9
SEQ_STEP = 128


def grown_shape(planned: tuple[int, int], shape: tuple[int, int]) -> tuple[int, int]:
    """The shape to plan for when ``shape`` is not covered: the larger rows and columns, the columns rounded up."""
    seq = max(planned[1], shape[1])
    return max(planned[0], shape[0]), -(-seq // SEQ_STEP) * SEQ_STEP


def batch_shape(batch: Any) -> tuple[int, int]:
    ids = batch["input_ids"] if isinstance(batch, Mapping) else getattr(batch, "input_ids", None)
    if ids is None:
        raise ValueError("schedule='milp' plans for the batch shape: the batch must carry input_ids (B, T)")
    return ids.shape[0], ids.shape[-1]


@dataclasses.dataclass
class LinkDrift:
    every: int = 50
    tolerance: float = 0.25
    probe: Callable[[], tuple[float, float, float]] | None = None
    events: list[dict] = dataclasses.field(default_factory=list)

    def check(self, step: int, profile: Profile | None) -> Profile | None:
        """The profile to re-plan with at ``step``, or None when no probe is due or nothing drifted."""
        if self.probe is None or profile is None or self.every <= 0 or step == 0 or step % self.every:
            return None
        was = (profile.h2d_bytes_per_s, profile.d2h_bytes_per_s, profile.duplex_bytes_per_s)
        now = tuple(float(v) for v in self.probe())
        drift = max(abs(n / w - 1.0) for n, w in zip(now, was, strict=True))
        if drift <= self.tolerance:
            return None
        self.events.append({"step": step, "was_bytes_per_s": was, "now_bytes_per_s": now, "drift": drift})
        log.warning(
            "lazytrain: link bandwidth drifted %.0f%% from the plan's profile (h2d/d2h/both %s -> %s GB/s);"
            " re-planning at step %d",
            100 * drift,
            _gb(was),
            _gb(now),
            step,
        )
        sources = {**profile.sources, "h2d": "measured", "d2h": "measured", "duplex": "measured"}
        return dataclasses.replace(
            profile, h2d_bytes_per_s=now[0], d2h_bytes_per_s=now[1], duplex_bytes_per_s=now[2], sources=sources
        )


def _gb(values: tuple[float, ...]) -> str:
    return "/".join(f"{v / GB:.1f}" for v in values)


class MilpPlan:
    """Keeps the run's MILP plan in ``resume.schedule_result`` (so checkpoints carry it) and the executor on it."""

    def __init__(self, settings: PlanSettings, resume: ResumeState, link_drift: LinkDrift,
                 num_slots: int | None) -> None:
        self.settings, self.resume, self.link_drift, self.num_slots = settings, resume, link_drift, num_slots

    def before_batch(self, batch: Any, executor: StreamingExecutor, step: int, log_dir: str) -> None:
        shape, planned, saved = batch_shape(batch), self.resume.plan_shape, None
        if self.resume.schedule_result is not None and planned is not None:
            if covers(planned, shape):
                self._maybe_replan(executor, step, log_dir)
                return
            grown = grown_shape(planned, shape)
            log.warning("lazytrain: batch %d x %d is larger than the %d x %d the plan was solved for: solving it for "
                        "%d x %d", *shape, *planned, *grown)
            shape = grown
            self.resume.oom_ladder.rearm(step)
        elif (found := self.resume.saved_plan(shape)) is not None:
            shape, saved = found
        self.resume.plan_shape = shape
        self.resume.schedule_result = saved or self._solve(executor, shape)
        executor.set_plan(self.resume.schedule_result, self.num_slots)
        if saved is not None:
            log.info("lazytrain: running the plan saved in the checkpoint for batch %d x %d", *shape)
            return
        path = write_plan(self.resume.schedule_result, log_dir)
        log.info("lazytrain: plan for batch %d x %d written to %s", *shape, path)

    def _solve(self, executor: StreamingExecutor, shape: tuple[int, int], profile: Profile | None = None) -> Schedule:
        """The plan budgets from the device memory free now: blocks the allocator still caches from earlier steps
        are not in use, but would count as taken (a mid-run plan would get less than the first one did)."""
        if executor.device.type == "cuda":
            torch.cuda.empty_cache()
        return solve_plan(self.settings, executor, *shape, profile=profile)

    def _maybe_replan(self, executor: StreamingExecutor, step: int, log_dir: str) -> None:
        """At a step boundary: solve again when the link drifted from the profile the plan was solved for."""
        if self.link_drift.probe is None and executor.device.type == "cuda":
            self.link_drift.probe = functools.partial(measure_link_cuda, executor.device)
        profile = self.link_drift.check(step, getattr(self.resume.schedule_result, "profile", None))
        if profile is None or self.resume.plan_shape is None:
            return
        schedule = self._solve(executor, self.resume.plan_shape, profile)
        self.resume.schedule_result = schedule
        executor.set_plan(schedule, self.num_slots)
        path = write_plan(schedule, log_dir)
        log.warning("lazytrain: re-planned at step %d: %s, predicted exposed %.3f s, written to %s",
                    step, schedule.counts(), schedule.predicted_exposed_seconds, path)
