"""The MILP with kept graphs, weight slots and working sets against brute force over every plan.

Reference: `milp_brute_force` over every tier assignment x every set of layers keeping their graph, memory counted
from the step's timeline there (not from `milp_memory.py`), transfers placed on the aggregated windows, shrunk for
the kept layers.
"""

import dataclasses

import pytest
from milp_brute_force import GIB, brute_force, choice_of, gpu_peak, memory_problem, plan_cost

from lightning_lazytrain.schedule import InfeasibleScheduleError, solve


@pytest.mark.parametrize("seed", range(12))
def test_memory_milp_matches_brute_force(seed):
    p = memory_problem(seed)
    ref = brute_force(p)
    if ref is None:
        with pytest.raises(InfeasibleScheduleError):
            solve(p, mip_gap=1e-9)
        return
    s = solve(p, time_limit=30, mip_gap=1e-9)
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert plan_cost(p, s.homes, choice_of(s)) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert s.info["gpu_bytes"] == gpu_peak(p, s.homes, choice_of(s)) <= p.gpu_total_bytes
    assert all(s.keep_graph[j] for j in p.keep_graph_layers)


def test_brute_force_memory_instances_are_not_trivial():
    # Some optimum keeps a graph and some does not; some instance is cut by the device total, not the budgets.
    kept, declined, infeasible = 0, 0, 0
    for seed in range(12):
        ref = brute_force(memory_problem(seed))
        if ref is None:
            infeasible += 1
            continue
        kept += any(ref[2])
        declined += not all(ref[2])
    assert kept and declined and infeasible < 10


def test_working_set_that_cannot_fit_is_refused_with_the_shortfall():
    p = dataclasses.replace(memory_problem(0), working_bytes=[8 * GIB] * 3, gpu_total_bytes=4 * GIB)
    with pytest.raises(InfeasibleScheduleError, match=r"GPU memory short by .* working set"):
        solve(p)


def test_forced_graphs_over_the_activation_budget_are_refused():
    p = dataclasses.replace(
        memory_problem(0), graph_bytes=[4 * GIB] * 3, keep_graph_layers=[1, 2], gpu_total_bytes=None
    )
    with pytest.raises(InfeasibleScheduleError, match=r"keep_graph_layers \[1, 2\]"):
        solve(p)
