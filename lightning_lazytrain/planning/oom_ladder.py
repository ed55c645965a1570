"""Out of GPU memory in the first steps: re-plan one rung down and run the step again, instead of stopping.

Rungs, in order, each logged; a rung that would not change the plan is skipped:

1. ``smaller GPU budget``: an MILP plan is solved again with half the GPU activation budget; any other plan drops
   its kept graphs (the largest GPU holders beyond the boundaries).
2. ``more recompute``: every other saved interior boundary is recomputed instead, and no graph is kept.
3. ``CPU/NVMe homes``: every saved interior boundary still on the GPU moves to the CPU (alternately to NVMe when a
   spill dir is set).
4. ``smaller layer micro-batches``: every layer runs the batch in twice as many row slices as before
   (``Schedule.micro_batches``, `engine/compute/micro_batches.py`), taken again on each later OOM until a slice is one
   row.
   The user's batch, loss and optimizer step are unchanged, so unlike Lightning's gradient accumulation it needs
   no change to the training loop; what it cannot shrink is the whole-batch boundaries and the head's chunk.

The strategy runs each optimizer step through `step_with_fallback`, the one retry loop: on an out-of-memory error
the failed step is discarded, the run's plan (`run_plan.RunPlan`) adopts the next rung's plan and the step runs
again. When no rung is left, or after the first ``steps`` optimizer steps of the running plan (the run's first, or
one solved mid-run for a larger batch, `replan.py`), the error is today's ``GpuMemoryError``.

What the ladder changed goes into checkpoints (`run_plan.RunPlan.state_dict`): a run resumed past the first steps
has no ladder left, so it must start on the plan and settings that fit, not on the ones that ran out of memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from lightning_lazytrain.engine import Schedule, StreamingExecutor
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.faults import GpuMemoryError, gpu_out_of_memory

log = logging.getLogger(__name__)
T = TypeVar("T")
RUNGS = ("smaller GPU budget", "more recompute", "CPU/NVMe homes", "smaller layer micro-batches")
#: the plan settings a rung may change (``schedule`` only identifies the run they belong to)
LOWERED = ("schedule", "gpu_activation_gib", "layer_micro_batches")


def _rung_plan(plan: Schedule, homes: list[str], keep_graph: list[bool], rung: str,
               mlp_recompute: list[bool] | None = None, micro_batches: int | None = None) -> Schedule:
    # No recompute span: a rung may lengthen blocks past the one the plan was solved under, and that is the point.
    return Schedule(homes, status=f"oom rung: {rung}", keep_graph=keep_graph, mlp_recompute=mlp_recompute,
                    micro_batches=micro_batches or plan.micro_batches)


def drop_graphs(plan: Schedule) -> Schedule:
    return _rung_plan(plan, plan.homes, [False] * plan.num_layers, RUNGS[0])


def more_recompute(plan: Schedule) -> Schedule:
    homes, saved = list(plan.homes), [i for i, h in enumerate(plan.homes[1:-1], start=1) if h != "recompute"]
    for i in saved[::2]:
        homes[i] = "recompute"
    return _rung_plan(plan, homes, [False] * plan.num_layers, RUNGS[1])


def host_homes(plan: Schedule, spill_dir: str | None) -> Schedule:
    homes = list(plan.homes)
    on_gpu = [i for i, h in enumerate(homes[1:-1], start=1) if h == "gpu" and not _graph_input(plan, i)]
    for k, i in enumerate(on_gpu):
        homes[i] = "nvme" if spill_dir is not None and k % 2 else "cpu"
    return _rung_plan(plan, homes, plan.keep_graph, RUNGS[2], plan.mlp_recompute)


def smaller_micro_batches(plan: Schedule, rows: int) -> Schedule:
    """The same placement with twice the layer micro-batches, at most one row each (``rows``: the batch's)."""
    micro = max(plan.micro_batches, min(2 * plan.micro_batches, rows))
    return _rung_plan(plan, plan.homes, plan.keep_graph, RUNGS[3], plan.mlp_recompute, micro)


def _graph_input(plan: Schedule, i: int) -> bool:
    return i < plan.num_layers and plan.keep_graph[i]


@dataclasses.dataclass
class OomLadder:
    """Which rung comes next and which were taken; the run's plan (`run_plan.RunPlan`) asks it for a rung's plan
    and keeps the plan and the settings that rung gave."""

    steps: int = 3
    rung: int = 0
    taken: list[str] = dataclasses.field(default_factory=list)
    #: the step the running plan was solved at: a plan solved mid-run for a larger batch gets its own first steps
    since: int = 0
    #: the plan the last rung gave, which checkpoints carry (None before any rung)
    plan: Schedule | None = None

    def applies(self, step: int, accumulate_grad_batches: int) -> bool:
        """Whether an OOM at ``step`` may be re-planned: the first ``steps`` steps of the running plan, no
        accumulation (a half-done accumulation cannot be run again), a rung left."""
        return step - self.since < self.steps and accumulate_grad_batches == 1 and self.rung < len(RUNGS)

    def rearm(self, step: int) -> None:
        """A new plan from ``step`` on (solved for a larger batch): the ladder starts again from its first rung."""
        self.since, self.rung = step, 0

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
                self.plan = candidate
                return candidate
        return None


def _first_sentences(failure: BaseException | None) -> str:
    """CUDA's message up to the device totals ("CUDA out of memory. Tried to allocate 2.03 GiB")."""
    return str(failure).split(". GPU")[0] if failure is not None else "unknown"


class FallbackPlan(Protocol):
    """What the retry loop asks of the run's plan (`run_plan.RunPlan`): its ladder, the plan running now and the
    batch shape it was solved for (both named in the error), and to adopt the next rung's plan (False: none left)."""

    ladder: OomLadder
    schedule: Schedule | None
    shape: tuple[int, int] | None

    def take_rung(self, executor: StreamingExecutor, failure: BaseException) -> bool: ...


def step_with_fallback(
    run_step: Callable[[], T],
    plan: FallbackPlan,
    executor: StreamingExecutor,
    step: int,
    accumulate_grad_batches: int,
    alone: bool,
) -> T:
    """``run_step()``; on an out-of-memory error in the ladder's steps (``alone``: this process may change its plan
    by itself), the failed step is discarded, the next rung's plan adopted and the step run again. Otherwise the
    error is `faults.GpuMemoryError`, naming the plan that ran out."""
    while True:
        try:
            return run_step()
        except torch.OutOfMemoryError as exc:
            if not (alone and plan.ladder.applies(step, accumulate_grad_batches)):
                raise _out_of_memory(exc, plan, executor) from exc
            failure = exc.with_traceback(None)  # its frames hold the failed step's tensors
        # outside the except block the failed step's frames are gone: free the GPU memory they held before the
        # next rung is planned, or its budget would be what the failed step left free
        executor.discard_step()
        if executor.device.type == "cuda":
            torch.cuda.empty_cache()
        if not plan.take_rung(executor, failure):
            raise _out_of_memory(failure, plan, executor) from failure


def plan_summary(plan: Schedule | None) -> str:
    """A ``Schedule`` in a line: how many boundaries live in each home, and how many layers keep their graph."""
    if plan is None:
        return "not set"
    slices = f", layers in {plan.micro_batches} row slices" if plan.micro_batches > 1 else ""
    return f"{plan.counts()}, {plan.graph_layers} layers keep their graph{slices}"


def _out_of_memory(exc: BaseException, plan: FallbackPlan, executor: StreamingExecutor) -> GpuMemoryError:
    free = device_free_bytes(executor.device) if executor.device.type == "cuda" else None
    return gpu_out_of_memory(exc, free, plan.shape, plan_summary(plan.schedule))
