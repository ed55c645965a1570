"""The MILP's third per-layer choice, a kept graph whose MLP re-runs (``mlp_recompute``), against brute force.

Reference: `milp_brute_force` over every tier assignment x every per-layer choice (re-run, keep the whole graph,
keep it with the MLP re-run), transfers placed on the aggregated windows.
"""

import pytest
from milp_brute_force import GIB, NONE, PART, WHOLE, brute_force, choice_of, gpu_peak, mlp_problem, plan_cost

from lightning_lazytrain.schedule import InfeasibleScheduleError, ScheduleProblem, solve


@pytest.mark.parametrize("seed", range(12))
def test_mlp_milp_matches_brute_force(seed):
    p = mlp_problem(seed)
    ref = brute_force(p)
    if ref is None:  # memory_problem's infeasible seeds stay infeasible: a partial graph is still a graph
        with pytest.raises(InfeasibleScheduleError):
            solve(p, mip_gap=1e-9)
        return
    s = solve(p, time_limit=30, mip_gap=1e-9)
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    choice = choice_of(s)
    assert plan_cost(p, s.homes, choice) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert s.info["gpu_bytes"] == gpu_peak(p, s.homes, choice)


def test_brute_force_mlp_instances_are_not_trivial():
    # some optimum picks the partial choice, and some picks a whole graph or a re-run while partial was offered
    picks = [brute_force(mlp_problem(seed)) for seed in range(12)]
    choices = [c for ref in picks if ref is not None for c in ref[2]]
    assert PART in choices and (WHOLE in choices or NONE in choices)


def _two_layers(gpu_budget: int) -> ScheduleProblem:
    """Two layers, no transfers: only the graphs compete for the GPU budget."""
    a = GIB // 4
    return ScheduleProblem(
        activation_bytes=[a, a, a], forward_seconds=[0.04, 0.04], window_seconds=[0.12, 0.12],
        param_h2d_bytes=[0, 0], grad_d2h_bytes=[0, 0], gpu_budget_bytes=gpu_budget, cpu_budget_bytes=0,
        nvme_budget_bytes=0, h2d_bytes_per_s=10 * GIB, d2h_bytes_per_s=10 * GIB, nvme_read_bytes_per_s=GIB,
        nvme_write_bytes_per_s=GIB, max_recompute_span=2, graph_bytes=[GIB, GIB],
        mlp_graph_bytes=[GIB // 4, GIB // 4], mlp_seconds=[0.015, 0.015], working_bytes=[0, 0],
        gpu_total_bytes=64 * GIB,
    )


@pytest.mark.parametrize(
    "extra,expected",
    [
        (2 * GIB, [WHOLE, WHOLE]),  # room for both whole graphs: no re-run at all
        (GIB // 2, [PART, PART]),  # room for two partial graphs, not one whole one beside the middle boundary
        (GIB, [PART, PART]),  # one whole graph fits, but two partial ones save more re-run time
        (GIB // 8, [NONE, NONE]),  # not even the middle boundary and a partial graph
    ],
)
def test_partial_choice_when_only_partial_graphs_fit(extra, expected):
    a = GIB // 4
    p = _two_layers(3 * a + extra)
    ref = brute_force(p)
    s = solve(p, mip_gap=1e-9)
    assert list(choice_of(s)) == list(ref[2]) == expected
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
