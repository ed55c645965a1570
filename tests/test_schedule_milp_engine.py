"""Solver with the engine's transfer rules (``solve(engine_windows=True)``) against brute force.

Reference: `milp_brute_force` with `engine_transfers`, the engine's timeline (written from `engine/compute/stack.py`,
not from `milp_transfers.py`'s index sets): tiers alone, then with kept graphs and MLP re-runs, whose backward parts
are shorter and whose blocks read no input back, so a reload below them starts further up.
"""

import random

import pytest
from milp_brute_force import (
    GIB,
    NONE,
    WHOLE,
    brute_force,
    choice_of,
    engine_transfers,
    memory_problem,
    mlp_problem,
    plan_cost,
    random_problem,
)

from lightning_lazytrain.schedule import InfeasibleScheduleError, ScheduleProblem, solve


def _check(p: ScheduleProblem) -> tuple | None:
    ref = brute_force(p, engine_transfers)
    if ref is None:
        with pytest.raises(InfeasibleScheduleError):
            solve(p, mip_gap=1e-9, engine_windows=True)
        return None
    s = solve(p, time_limit=30, mip_gap=1e-9, engine_windows=True)
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    # the plan itself achieves it, and fits
    assert plan_cost(p, s.homes, choice_of(s), engine_transfers) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    return ref


@pytest.mark.parametrize("seed", range(14))
def test_engine_windows_objective_matches_brute_force(seed):
    _check(random_problem(random.Random(seed), n=3 + seed % 3))


@pytest.mark.parametrize("seed", range(12))
def test_engine_windows_with_kept_graphs_match_brute_force(seed):
    _check(memory_problem(seed))


@pytest.mark.parametrize("seed", range(12))
def test_engine_windows_with_mlp_reruns_match_brute_force(seed):
    _check(mlp_problem(seed))


def test_a_reload_below_a_kept_graph_hides_in_the_block_above_it():
    """Four layers, boundary 1 on the CPU, layer 2 keeping its graph (forced): the reload of boundary 1 is started
    by block (3, 4), the first above that reads its input back, and runs through its backward and layer 2's: 0.75
    GiB at 10 GiB/s takes 75 ms, layer 2's backward part alone is 40 ms, with block (3, 4)'s 80 ms it hides.
    Boundary 3 on the CPU instead could only come back during the head, which takes no time."""
    n, a = 4, 3 * GIB // 4
    p = ScheduleProblem(
        activation_bytes=[a] * (n + 1),
        forward_seconds=[0.02] * n,
        window_seconds=[0.1] * n,
        rerun_seconds=[0.04] * n,
        param_h2d_bytes=[0] * n,
        grad_d2h_bytes=[0] * n,
        gpu_budget_bytes=4 * a,
        cpu_budget_bytes=a,
        nvme_budget_bytes=0,
        h2d_bytes_per_s=10 * GIB,
        d2h_bytes_per_s=20 * GIB,
        nvme_read_bytes_per_s=GIB,
        nvme_write_bytes_per_s=GIB,
        max_recompute_span=1,
        keep_graph_layers=[2],
        lambda_materialize=0.0,
        lambda_cpu=0.0,
    )
    tiers = ["gpu", "cpu", "gpu", "gpu", "gpu"]
    assert engine_transfers(p, tiers, [False, False, True, False]) == 0.0
    ref = _check(p)
    assert ref[1] == tiers and ref[2] == (NONE, NONE, WHOLE, NONE)


def test_brute_force_engine_instances_are_not_trivial():
    """Some optimum holds a graph above a boundary that is reloaded, where the engine's early start matters."""
    above = 0
    for seed in range(12):
        ref = brute_force(mlp_problem(seed), engine_transfers)
        if ref is not None:
            _, tiers, choice = ref
            moved = [i for i, t in enumerate(tiers) if t in ("cpu", "nvme")]
            above += any(choice[j] != NONE for i in moved for j in range(i + 1, len(choice)))
    assert above
