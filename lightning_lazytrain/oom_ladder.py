"""Out of GPU memory in the first steps: re-plan one rung down and run the step again, instead of stopping.

Rungs, in order, each logged; a rung that would not change the plan is skipped:

1. ``smaller GPU budget``: an MILP plan is solved again with half the GPU activation budget; any other plan drops
   its kept graphs (the largest GPU holders beyond the boundaries).
2. ``more recompute``: every other saved interior boundary is recomputed instead, and no graph is kept.
3. ``CPU/NVMe homes``: every saved interior boundary still on the GPU moves to the CPU (alternately to NVMe when a
   spill dir is set).
4. ``smaller layer micro-batches``: every layer runs the batch in twice as many row slices as before
   (``Schedule.micro_batches``, `engine/micro_batches.py`), taken again on each later OOM until a slice is one row.
   The user's batch, loss and optimizer step are unchanged, so unlike Lightning's gradient accumulation it needs
   no change to the training loop; what it cannot shrink is the whole-batch boundaries and the head's chunk.

When no rung is left, or after the first ``steps`` optimizer steps of the running plan (the run's first, or one
solved mid-run for a larger batch, `replan.py`), the error is today's ``GpuMemoryError``.

What the ladder changed goes into checkpoints (:meth:`OomLadder.state_dict`): a run resumed past the first steps
has no ladder left, so it must start on the plan and settings that fit, not on the ones that ran out of memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from lightning_lazytrain.engine import Schedule, StreamingExecutor

log = logging.getLogger(__name__)
RUNGS = ("smaller GPU budget", "more recompute", "CPU/NVMe homes", "smaller layer micro-batches")
#: the plan settings a rung may change (``schedule`` only identifies the run they belong to)
_LOWERED = ("schedule", "gpu_activation_gib", "layer_micro_batches")


def _rung_plan(plan: Schedule, tiers: list[str], keep_graph: list[bool], rung: str,
               mlp_recompute: list[bool] | None = None, micro_batches: int | None = None) -> Schedule:
    # No recompute span: a rung may lengthen blocks past the one the plan was solved under, and that is the point.
    return Schedule(tiers, status=f"oom rung: {rung}", keep_graph=keep_graph, mlp_recompute=mlp_recompute,
                    micro_batches=micro_batches or plan.micro_batches)


def drop_graphs(plan: Schedule) -> Schedule:
    return _rung_plan(plan, plan.tiers, [False] * plan.num_layers, RUNGS[0])


def more_recompute(plan: Schedule) -> Schedule:
    homes, saved = list(plan.tiers), [i for i, h in enumerate(plan.tiers[1:-1], start=1) if h != "recompute"]
    for i in saved[::2]:
        homes[i] = "recompute"
    return _rung_plan(plan, homes, [False] * plan.num_layers, RUNGS[1])


def host_homes(plan: Schedule, spill_dir: str | None) -> Schedule:
    homes = list(plan.tiers)
    on_gpu = [i for i, h in enumerate(homes[1:-1], start=1) if h == "gpu" and not _graph_input(plan, i)]
    for k, i in enumerate(on_gpu):
        homes[i] = "nvme" if spill_dir is not None and k % 2 else "cpu"
    return _rung_plan(plan, homes, plan.keep_graph, RUNGS[2], plan.mlp_recompute)


def smaller_micro_batches(plan: Schedule, rows: int) -> Schedule:
    """The same placement with twice the layer micro-batches, at most one row each (``rows``: the batch's)."""
    micro = max(plan.micro_batches, min(2 * plan.micro_batches, rows))
    return _rung_plan(plan, plan.tiers, plan.keep_graph, RUNGS[3], plan.mlp_recompute, micro)


def _graph_input(plan: Schedule, i: int) -> bool:
    return i < plan.num_layers and plan.keep_graph[i]


@dataclasses.dataclass
class OomLadder:
    """``resolve(gpu_fraction)`` re-solves the MILP with that share of the GPU activation budget (None when the
    plan is not an MILP plan)."""

    steps: int = 3
    rung: int = 0
    taken: list[str] = dataclasses.field(default_factory=list)
    #: the step the running plan was solved at: a plan solved mid-run for a larger batch gets its own first steps
    since: int = 0
    #: after a rung: the plan it gave, and the plan settings then (schedule, GPU budget, micro-batches)
    plan: Schedule | None = None
    settings_after: dict[str, Any] = dataclasses.field(default_factory=dict)
    _pending: dict[str, Any] | None = None

    def applies(self, step: int, accumulate_grad_batches: int) -> bool:
        """Whether an OOM at ``step`` may be re-planned: the first ``steps`` steps of the running plan, no
        accumulation (a half-done accumulation cannot be run again), a rung left."""
        return step - self.since < self.steps and accumulate_grad_batches == 1 and self.rung < len(RUNGS)

    def rearm(self, step: int) -> None:
        """A new plan from ``step`` on (solved for a larger batch): the ladder starts again from its first rung."""
        self.since, self.rung = step, 0

    def plan_after_oom(self, executor: StreamingExecutor, settings, shape: tuple[int, int] | None,
                       failure: BaseException | None = None) -> Schedule | None:
        """The next rung's plan, or None when no rung changes the plan. Call it once the failed step's device
        memory is released: an MILP rung budgets from what is free then. The micro-batch rung is kept in
        ``settings`` too, so that a later re-plan solves for it."""
        milp = settings.kind() == "milp" and shape is not None
        resolve = milp_resolver(settings, executor, shape) if milp else None
        plan = self.next_plan(executor.plan, settings.spill_dir, resolve, failure, executor.batch_rows)
        if plan is not None:
            settings.layer_micro_batches = plan.micro_batches
            self.plan = plan
            self.settings_after = {name: getattr(settings, name) for name in _LOWERED}
        return plan

    def state_dict(self) -> dict[str, Any] | None:
        if self.plan is None:
            return None
        return {"rung": self.rung, "taken": list(self.taken), "plan": self.plan.to_json(),
                "settings": dict(self.settings_after)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Kept until :meth:`restore` at the first resumed batch (the executor does not exist at load time)."""
        self._pending = state

    def forget_pending(self) -> None:
        self._pending = None

    def restore(self, executor: StreamingExecutor, settings, num_slots: int | None) -> None:
        """Put a resumed run back where the saving run's ladder left it: the settings it lowered (so re-plans keep
        them) and, for a plan that is not the MILP's (whose solved plan the checkpoint carries already), the rung's
        plan. Skipped, with a log line, when the user changed the schedule since."""
        state, self._pending = self._pending, None
        if state is None:
            return
        saved = state["settings"]
        plan = Schedule.from_json(state["plan"])
        if saved["schedule"] != settings.schedule or plan.num_layers != executor.plan.num_layers:
            log.warning("lazytrain: the checkpoint's OOM fallback plan (for schedule=%r) is not restored: this run "
                        "has schedule=%r", saved["schedule"], settings.schedule)
            return
        for name in _LOWERED:
            setattr(settings, name, saved[name])
        self.rung, self.taken, self.plan, self.settings_after = state["rung"], list(state["taken"]), plan, saved
        if settings.kind() != "milp":
            executor.set_plan(plan, num_slots)
        log.info("lazytrain: resumed on the plan the OOM fallback ladder chose (%s): %s, %d layer micro-batches",
                 ", ".join(self.taken), plan.counts(), plan.micro_batches)

    def next_plan(
        self, plan: Schedule, spill_dir: str | None, resolve: Callable[[float], Schedule | None] | None,
        failure: BaseException | None = None, rows: int = 0,
    ) -> Schedule | None:
        """The plan of the next rung that changes ``plan``, or None when none is left (``rows``: the failed
        batch's, which bounds the micro-batch rung). The log names the failed allocation, the one number that
        tells a plan's under-count from fragmentation."""
        while self.rung < len(RUNGS):
            name = RUNGS[self.rung]
            if name == RUNGS[0]:
                candidate = (resolve(0.5) if resolve is not None else None) or drop_graphs(plan)
            elif name == RUNGS[1]:
                candidate = more_recompute(plan)
            elif name == RUNGS[2]:
                candidate = host_homes(plan, spill_dir)
            else:
                candidate = smaller_micro_batches(plan, rows)
            if name != RUNGS[3] or candidate.same_placement(plan):
                self.rung += 1  # the micro-batch rung is taken again until it changes nothing
            if not candidate.same_placement(plan):
                self.taken.append(name)
                log.warning(
                    "lazytrain: out of GPU memory; fallback rung %d (%s): plan %s, %d kept graphs, %d layer "
                    "micro-batches; it failed at: %s",
                    RUNGS.index(name) + 1,
                    name,
                    candidate.counts(),
                    candidate.graph_layers,
                    candidate.micro_batches,
                    _first_sentences(failure),
                )
                return candidate
        return None


def _first_sentences(failure: BaseException | None) -> str:
    """CUDA's message up to the device totals ("CUDA out of memory. Tried to allocate 2.03 GiB")."""
    return str(failure).split(". GPU")[0] if failure is not None else "unknown"


def milp_resolver(settings, executor: StreamingExecutor, shape: tuple[int, int]) -> Callable[[float], Schedule]:
    """``resolve(fraction)``: the MILP solved again for ``shape`` with ``fraction`` of the current GPU budget."""
    from lightning_lazytrain.planner import GIB, budgets, solve_plan

    def resolve(fraction: float) -> Schedule:
        gpu = budgets(settings, executor)[0] * fraction
        settings.gpu_activation_gib = gpu / GIB  # later rungs and re-plans keep the smaller budget
        return solve_plan(settings, executor, *shape)

    return resolve
