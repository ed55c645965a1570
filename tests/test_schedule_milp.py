"""Solver vs brute force, budgets, span and infeasibility.

Reference: `milp_brute_force` over every tier assignment, transfers placed on the aggregated windows.
"""

import random

import pytest
from milp_brute_force import GIB, brute_force, plan_cost, random_problem

from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.schedule import (
    InfeasibleScheduleError,
    ScheduleProblem,
    min_stored_bytes,
    solve,
)


@pytest.mark.parametrize("seed", range(14))
def test_objective_matches_brute_force(seed):
    rng = random.Random(seed)
    p = random_problem(rng, n=3 + seed % 3)
    ref = brute_force(p)
    if ref is None:
        with pytest.raises(InfeasibleScheduleError):
            solve(p, mip_gap=1e-9)
        return
    s = solve(p, time_limit=30, mip_gap=1e-9)
    assert s.status == "optimal"
    assert s.objective == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    # The returned tiers must themselves achieve the optimum (not just the reported number).
    assert plan_cost(p, s.homes) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    ties = sum(p.lambda_materialize for t in s.homes[1:-1] if t != "recompute")
    ties += sum({"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(t, 0.0) for t in s.homes)
    assert s.predicted_exposed_seconds == pytest.approx(ref[0] - ties, rel=1e-6, abs=1e-8)


def test_brute_force_instances_are_not_trivial():
    # Guard against a test set where every answer is "all GPU": some optimum must use each non-GPU tier.
    used = set()
    for seed in range(14):
        ref = brute_force(random_problem(random.Random(seed), n=3 + seed % 3))
        if ref:
            used.update(ref[1])
    assert used == {"gpu", "cpu", "nvme", "recompute"}


def _check_plan(p: ScheduleProblem, s) -> None:
    a = p.activation_bytes
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        assert sum(a[i] for i, t in enumerate(s.homes) if t == tier) <= budget
    assert all(e - s_ <= p.max_recompute_span for s_, e in s.blocks())


@pytest.mark.parametrize("span", [1, 2, 3, 5])
def test_budgets_and_span_honoured_at_24_layers(span):
    n = 24
    a = [GIB // 2] * (n + 1)
    p = ScheduleProblem(
        activation_bytes=a, forward_seconds=[0.02] * n, window_seconds=[0.06] * n, param_h2d_bytes=[GIB // 2] * n,
        grad_d2h_bytes=[GIB // 4] * n, gpu_budget_bytes=6 * GIB, cpu_budget_bytes=3 * GIB,
        nvme_budget_bytes=2 * GIB, h2d_bytes_per_s=20 * GIB, d2h_bytes_per_s=20 * GIB,
        nvme_read_bytes_per_s=2 * GIB, nvme_write_bytes_per_s=GIB, max_recompute_span=span)
    if min_stored_bytes(p)[0] > 11 * GIB:
        with pytest.raises(InfeasibleScheduleError, match="short by"):
            solve(p)
        return
    s = solve(p, time_limit=20, mip_gap=1e-6)
    _check_plan(p, s)
    counts = s.counts()
    assert counts["gpu"] == 12  # the GPU budget is worth using fully: it is free
    # Better than (or equal to) the MegaTrain policy with the same span.
    assert s.predicted_exposed_seconds <= sum(p.recompute_seconds(b, e) for b, e in Schedule.every(n, span).blocks())


def test_gpu_ends_shortfall_message():
    p = ScheduleProblem(
        activation_bytes=[GIB] * 5, forward_seconds=[0.01] * 4, window_seconds=[0.03] * 4,
        param_h2d_bytes=[0] * 4, grad_d2h_bytes=[0] * 4, gpu_budget_bytes=GIB + GIB // 2, cpu_budget_bytes=10 * GIB,
        nvme_budget_bytes=0, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, nvme_read_bytes_per_s=1e9,
        nvme_write_bytes_per_s=1e9, max_recompute_span=4)
    with pytest.raises(InfeasibleScheduleError, match=r"GPU activation budget short by 0\.500 GiB"):
        solve(p)


def test_total_shortfall_message_names_tiers_and_gib():
    n = 8
    p = ScheduleProblem(
        activation_bytes=[GIB] * (n + 1), forward_seconds=[0.01] * n, window_seconds=[0.03] * n,
        param_h2d_bytes=[0] * n, grad_d2h_bytes=[0] * n, gpu_budget_bytes=3 * GIB, cpu_budget_bytes=GIB,
        nvme_budget_bytes=0, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, nvme_read_bytes_per_s=1e9,
        nvme_write_bytes_per_s=1e9, max_recompute_span=1)
    # span 1 => all 9 boundaries saved, 4 GiB available => 5 GiB short.
    with pytest.raises(InfeasibleScheduleError, match=r"GPU\+CPU\+NVMe activation budget short by 5\.000 GiB") as ei:
        solve(p)
    assert "spill dir" in str(ei.value) and isinstance(ei.value, ValueError)


def test_packing_infeasible_after_precheck():
    # Enough bytes in total, but a 2 GiB boundary cannot be split across two 1 GiB homes.
    p = ScheduleProblem(
        activation_bytes=[GIB, 2 * GIB, GIB], forward_seconds=[0.01] * 2, window_seconds=[0.03] * 2,
        param_h2d_bytes=[0] * 2, grad_d2h_bytes=[0] * 2, gpu_budget_bytes=3 * GIB, cpu_budget_bytes=GIB,
        nvme_budget_bytes=0, h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, nvme_read_bytes_per_s=1e9,
        nvme_write_bytes_per_s=1e9, max_recompute_span=1)
    with pytest.raises(InfeasibleScheduleError, match="cannot be packed"):
        solve(p)


def test_single_layer_and_free_transfers():
    p = ScheduleProblem(
        activation_bytes=[GIB, GIB], forward_seconds=[0.01], window_seconds=[0.03], param_h2d_bytes=[0],
        grad_d2h_bytes=[0], gpu_budget_bytes=2 * GIB, cpu_budget_bytes=0, nvme_budget_bytes=0,
        h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9,
        max_recompute_span=1)
    s = solve(p)
    assert s.homes == ["gpu", "gpu"] and s.predicted_exposed_seconds == 0 and s.blocks() == [(0, 1)]
