"""The MILP's third per-layer choice, a kept graph whose MLP re-runs (``mlp_recompute``), against brute force.

Reference: every tier assignment x every per-layer choice (re-run, keep the whole graph, keep it with the MLP
re-run). A partial keep is costed as a whole keep with ``mlp_graph_bytes`` as its graph and ``mlp_seconds`` added
(its window is a kept layer's, as ``milp_memory.py`` says), by the timeline model of `test_schedule_milp_memory`.
"""

import dataclasses
import itertools
import random

import pytest
from test_schedule_milp import GIB
from test_schedule_milp_memory import gpu_peak, memory_problem, plan_cost

from lightning_lazytrain.schedule import InfeasibleScheduleError, ScheduleProblem, solve

NONE, WHOLE, PART = 0, 1, 2


def as_whole(p: ScheduleProblem, choice: tuple[int, ...]) -> ScheduleProblem:
    """``p`` with each partially kept layer's graph bytes standing in for its whole graph."""
    graph = [p.mlp_graph_bytes[j] if c == PART else p.graph_bytes[j] for j, c in enumerate(choice)]
    return dataclasses.replace(p, graph_bytes=graph, mlp_graph_bytes=None, mlp_seconds=None)


def choice_cost(p: ScheduleProblem, tiers: list[str], choice: tuple[int, ...]) -> float | None:
    keep = tuple(c != NONE for c in choice)
    cost = plan_cost(as_whole(p, choice), tiers, keep)
    if cost is None or any(choice[j] == PART for j in p.keep_graph_layers):
        return None
    return cost + sum(p.mlp_seconds[j] for j, c in enumerate(choice) if c == PART)


def brute_force(p: ScheduleProblem):
    best = None
    for inner in itertools.product(("gpu", "cpu", "nvme", "recompute"), repeat=p.num_layers - 1):
        tiers = ["gpu", *inner, "gpu"]
        for choice in itertools.product((NONE, WHOLE, PART), repeat=p.num_layers):
            c = choice_cost(p, tiers, choice)
            if c is not None and (best is None or c < best[0] - 1e-12):
                best = (c, tiers, choice)
    return best


def mlp_problem(seed: int) -> ScheduleProblem:
    p = memory_problem(seed)
    rng = random.Random(2000 + seed)
    n = p.num_layers
    # the MLP is most of a layer's graph and a third to a half of its forward
    part = [g * rng.randint(2, 5) // 10 for g in p.graph_bytes]
    mu = [f * rng.uniform(0.3, 0.6) for f in p.forward_seconds]
    return dataclasses.replace(p, mlp_graph_bytes=part, mlp_seconds=mu, keep_graph_layers=p.keep_graph_layers[:n])


def _choice(s) -> tuple[int, ...]:
    return tuple(PART if r else WHOLE if k else NONE for k, r in zip(s.keep_graph, s.mlp_recompute, strict=True))


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
    choice = _choice(s)
    assert choice_cost(p, s.tiers, choice) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert s.info["gpu_bytes"] == gpu_peak(as_whole(p, choice), s.tiers, tuple(c != NONE for c in choice))


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
    assert list(_choice(s)) == list(ref[2]) == expected
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
