"""The largest batch the GPU takes: doubling, then bisection, with a test that needs no solve, then one forecast.

The test (`admits`) asks the questions the MILP's memory rows ask (`milp_memory.py`) of the problem the forecast
builds: for an MILP plan, whether some plan fits them; for an interval or JSON plan, whether that plan does. So the
batch it settles on is one whose plan the MILP accepts, and the one above it has none.
"""

from __future__ import annotations

from collections.abc import Callable

from .forecast import Forecast, Machine, RunSpec, forecast, gpu_total_bytes, plan, problem_for
from .milp import InfeasibleScheduleError, precheck
from .milp_memory import plan_gpu_bytes
from .problem import ScheduleProblem
from .profile import Profile

MAX_BATCH = 1 << 14


def admits(run: RunSpec, machine: Machine, batch: int, profile_for: Callable[[int], Profile]) -> bool:
    """The cheap test: whether the GPU takes ``batch`` under the MILP's memory rows (no solve). Host RAM does not
    depend on the batch: the forecast's report says it."""
    try:
        problem = problem_for(run, machine, profile_for(batch))
    except ValueError:  # more forced graphs than layers: no batch fits
        return False
    if run.schedule.strip() != "milp":
        schedule = plan(run, problem)
        return plan_gpu_bytes(problem, schedule.tiers, schedule.keep_graph, schedule.mlp_recompute) <= (
            gpu_total_bytes(run, machine)
        )
    try:
        precheck(problem)
    except InfeasibleScheduleError:
        return False
    return some_plan_fits(problem)


def some_plan_fits(p: ScheduleProblem) -> bool:
    """Whether some plan meets the MILP's budget rows, for equal boundaries (the profiles of uniform models; other
    problems pass, and the MILP decides).

    A plan whose longest free block has ``k`` layers peaks at most at ``k`` slots (and the one copying out),
    ``k - 1`` rebuilt boundaries, the largest working set and ``reload_bytes``, and saves at least
    ``ceil(m / k) - 1`` boundaries inside each run of ``m`` layers
    between forced graphs; those go to whatever home still has room for a whole boundary. A forced graph holds its
    graph, a slot and its input boundary on the GPU; its output boundary is saved in some home. Exact when the
    layers' working sets are equal too; otherwise it may refuse a batch the MILP would take (never the reverse)."""
    a = p.activation_bytes
    if len(set(a)) != 1 or a[0] == 0:
        return True
    size, n = a[0], p.num_layers
    forced = set(p.keep_graph_layers)
    on_gpu = {j for j in forced if 0 < j < n}
    saved = sorted({0, n} | on_gpu | {j + 1 for j in forced})
    runs = [e - s for s, e in zip(saved[:-1], saved[1:]) if s not in forced]
    loose = len({j + 1 for j in forced if j + 1 < n} - on_gpu)  # forced outputs homed anywhere
    work = max(p.working_bytes) if p.working_bytes is not None else 0
    graphs = sum(p.graph_bytes[j] for j in forced) if p.graph_bytes is not None else 0
    held = 2 * size + len(on_gpu) * size + graphs
    forced_peaks = [p.block_peak_bytes(j, j + 1) for j in forced]
    for k in range(1, p.max_recompute_span + 1):
        longest = min(k, max(runs, default=0))
        block = (longest + 1) * p.slot_bytes + (longest - 1) * size + work + p.reload_bytes if longest else 0
        room = p.gpu_budget_bytes - held
        if p.gpu_total_bytes is not None:
            peak = max([p.head_peak_bytes, block, *forced_peaks])
            slots = (p.fixed_slots + len(forced)) * p.slot_bytes
            room = min(room, p.gpu_total_bytes - held - slots - peak)
        if room < 0:
            continue
        need = sum(-(-m // k) - 1 for m in runs) + loose
        if room // size + p.cpu_budget_bytes // size + p.nvme_budget_bytes // size >= need:
            return True
    return False


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
