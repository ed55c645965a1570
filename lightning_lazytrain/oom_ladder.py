"""Out of GPU memory in the first steps: re-plan one rung down and run the step again, instead of stopping.

Rungs, in order, each logged; a rung that would not change the plan is skipped:

1. ``smaller GPU budget``: an MILP plan is solved again with half the GPU activation budget; any other plan drops
   its kept graphs (the largest GPU holders beyond the boundaries).
2. ``more recompute``: every other saved interior boundary is recomputed instead, and no graph is kept.
3. ``CPU/NVMe homes``: every saved interior boundary still on the GPU moves to the CPU (alternately to NVMe when a
   spill dir is set).

When no rung is left, or after the first ``steps`` optimizer steps, the error is today's ``GpuMemoryError``. A
smaller micro-batch with accumulation (a fourth rung) is not built: it needs the training loop to split batches.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from lightning_lazytrain.engine import Schedule, StreamingExecutor

log = logging.getLogger(__name__)
RUNGS = ("smaller GPU budget", "more recompute", "CPU/NVMe homes")


def _rung_plan(
    tiers: list[str], keep_graph: list[bool], rung: str, mlp_recompute: list[bool] | None = None
) -> Schedule:
    # No recompute span: a rung may lengthen blocks past the one the plan was solved under, and that is the point.
    return Schedule(tiers, status=f"oom rung: {rung}", keep_graph=keep_graph, mlp_recompute=mlp_recompute)


def drop_graphs(plan: Schedule) -> Schedule:
    return _rung_plan(plan.tiers, [False] * plan.num_layers, RUNGS[0])


def more_recompute(plan: Schedule) -> Schedule:
    homes, saved = list(plan.tiers), [i for i, h in enumerate(plan.tiers[1:-1], start=1) if h != "recompute"]
    for i in saved[::2]:
        homes[i] = "recompute"
    return _rung_plan(homes, [False] * plan.num_layers, RUNGS[1])


def host_homes(plan: Schedule, spill_dir: str | None) -> Schedule:
    homes = list(plan.tiers)
    on_gpu = [i for i, h in enumerate(homes[1:-1], start=1) if h == "gpu" and not _graph_input(plan, i)]
    for k, i in enumerate(on_gpu):
        homes[i] = "nvme" if spill_dir is not None and k % 2 else "cpu"
    return _rung_plan(homes, plan.keep_graph, RUNGS[2], plan.mlp_recompute)


def _graph_input(plan: Schedule, i: int) -> bool:
    return i < plan.num_layers and plan.keep_graph[i]


@dataclasses.dataclass
class OomLadder:
    """``resolve(gpu_fraction)`` re-solves the MILP with that share of the GPU activation budget (None when the
    plan is not an MILP plan)."""

    steps: int = 3
    rung: int = 0
    taken: list[str] = dataclasses.field(default_factory=list)

    def applies(self, step: int, accumulate_grad_batches: int) -> bool:
        """Whether an OOM at ``step`` may be re-planned: the first ``steps`` steps, no accumulation (a half-done
        accumulation cannot be run again), a rung left."""
        return step < self.steps and accumulate_grad_batches == 1 and self.rung < len(RUNGS)

    def plan_after_oom(self, executor: StreamingExecutor, settings, shape: tuple[int, int] | None,
                       failure: BaseException | None = None) -> Schedule | None:
        """The next rung's plan, or None when no rung changes the plan. Call it once the failed step's device
        memory is released: an MILP rung budgets from what is free then."""
        milp = settings.kind() == "milp" and shape is not None
        resolve = milp_resolver(settings, executor, shape) if milp else None
        return self.next_plan(executor.plan, settings.spill_dir, resolve, failure)

    def next_plan(
        self, plan: Schedule, spill_dir: str | None, resolve: Callable[[float], Schedule | None] | None,
        failure: BaseException | None = None,
    ) -> Schedule | None:
        """The plan of the next rung that changes ``plan``, or None when none is left. The log names the failed
        allocation, the one number that tells a plan's under-count from fragmentation."""
        while self.rung < len(RUNGS):
            name, self.rung = RUNGS[self.rung], self.rung + 1
            if name == RUNGS[0]:
                candidate = (resolve(0.5) if resolve is not None else None) or drop_graphs(plan)
            elif name == RUNGS[1]:
                candidate = more_recompute(plan)
            else:
                candidate = host_homes(plan, spill_dir)
            if not candidate.same_placement(plan):
                self.taken.append(name)
                log.warning(
                    "lazytrain: out of GPU memory; fallback rung %d (%s): plan %s, %d kept graphs; it failed at: %s",
                    self.rung,
                    name,
                    candidate.counts(),
                    candidate.graph_layers,
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
