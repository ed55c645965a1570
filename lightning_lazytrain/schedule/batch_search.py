"""The largest batch the GPU takes: doubling, then bisection, with a test that needs no solve, then one forecast.

The test (`admits`) asks the questions the MILP's memory rows ask (`milp_memory.py`) of the problem the forecast
builds: for an MILP plan, whether some plan fits them; for an interval or JSON plan, whether that plan does. So the
batch it settles on is one whose plan the MILP accepts, and the one above it has none.
"""

from __future__ import annotations

from collections.abc import Callable

from .feasibility import plan_exists
from .forecast import Forecast, Machine, RunSpec, forecast, plan, plan_inputs, problem_for
from .milp_memory import plan_gpu_bytes
from .plan_inputs import gpu_total_bytes
from .profile import Profile

MAX_BATCH = 1 << 14


def admits(run: RunSpec, machine: Machine, batch: int, profile_for: Callable[[int], Profile]) -> bool:
    """The cheap test: whether the GPU takes ``batch`` under the MILP's memory rows (no solve). Host RAM does not
    depend on the batch: the forecast's report says it."""
    try:
        problem = problem_for(run, machine, profile_for(batch))
    except ValueError:  # more forced graphs than layers: no batch fits
        return False
    if run.plan_settings.kind() != "milp":
        schedule = plan(run, problem)
        return plan_gpu_bytes(problem, schedule.homes, schedule.keep_graph, schedule.mlp_recompute) <= (
            gpu_total_bytes(plan_inputs(run, machine)) or 0
        )
    return plan_exists(problem)


def largest_batch(
    run: RunSpec, machine: Machine, profile_for: Callable[[int], Profile], tries: int = 3
) -> Forecast | None:
    """The largest batch the GPU takes: the largest the cheap test admits (doubling, then bisection), confirmed by
    a full forecast; a batch whose forecast finds no plan steps down by one, ``tries`` times at most. None when
    not even batch 1 is admitted."""
    if not admits(run, machine, 1, profile_for):
        return None
    low, high = 1, 2  # admits(low); high is the first batch known not to be admitted (or past MAX_BATCH)
    while high <= MAX_BATCH and admits(run, machine, high, profile_for):
        low, high = high, high * 2
    high = min(high, MAX_BATCH + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if admits(run, machine, mid, profile_for) else (low, mid)
    for batch in range(low, max(0, low - tries), -1):
        result = forecast(run, machine, batch, profile_for)
        if result.fits_gpu:
            return result
    return result
