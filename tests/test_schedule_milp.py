"""Solver vs brute force, budgets, span and infeasibility.

Reference: enumerate every tier assignment, solve the transfer LP directly (highspy, not Pyomo).

Written from the timeline rather than from the MILP's index sets, so a wrong window rule in `milp.py` shows up
as an objective mismatch. Timeline of one step: F_0 .. F_{L-1}, HEAD, B_{L-1} .. B_0; slots F_w and B_w share
window w's capacity (the aggregated window), HEAD is window L.
"""

import itertools
import random

import highspy
import pytest

from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.schedule import (
    InfeasibleScheduleError,
    ScheduleProblem,
    min_stored_bytes,
    solve,
)

GIB = 1 << 30


def _timeline(n: int) -> list[tuple[str, int]]:
    return [("F", w) for w in range(n)] + [("H", n)] + [("B", w) for w in reversed(range(n))]


def transfer_cost(p: ScheduleProblem, tiers: list[str]) -> float:
    """Least charged slack seconds for a fixed tier assignment (transfers placed optimally)."""
    n = p.num_layers
    tl = _timeline(n)
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    block_end = {s: e for s, e in zip(saved[:-1], saved[1:], strict=True)}
    movers = [i for i in range(1, n) if tiers[i] in ("cpu", "nvme") and p.activation_bytes[i] > 0]
    if not movers:
        return 0.0
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    secs = list(p.window_seconds) + [p.head_seconds]
    ph = list(p.param_h2d_bytes) + [0]
    gd = list(p.grad_d2h_bytes) + [0]
    pcie_d = {w: [] for w in range(n + 1)}
    pcie_h = {w: [] for w in range(n + 1)}
    disk_w = {w: [] for w in range(n + 1)}
    disk_r = {w: [] for w in range(n + 1)}
    for i in movers:
        a = p.activation_bytes[i] / float(GIB)
        produced = tl.index(("F", i - 1)) if i >= 1 else -1
        needed = tl.index(("B", block_end[i] - 1))  # the block's backward (re-forward from i) starts here
        head = tl.index(("H", n))
        off = [h.addVariable(lb=0) for pos in range(produced + 1, head + 1)]
        off_w = [tl[pos][1] for pos in range(produced + 1, head + 1)]
        rel = [h.addVariable(lb=0) for pos in range(head, needed)]
        rel_w = [tl[pos][1] for pos in range(head, needed)]
        h.addConstr(sum(off) == a)
        h.addConstr(sum(rel) == a)
        for v, w in zip(off, off_w, strict=True):
            pcie_d[w].append(v)
            if tiers[i] == "nvme":
                disk_w[w].append(v)
        for v, w in zip(rel, rel_w, strict=True):
            pcie_h[w].append(v)
            if tiers[i] == "nvme":
                disk_r[w].append(v)
    cost = 0
    for w in range(n + 1):
        for vars_, cap, bw in ((pcie_d[w], secs[w] * p.d2h_bytes_per_s - gd[w], p.d2h_bytes_per_s),
                               (pcie_h[w], secs[w] * p.h2d_bytes_per_s - ph[w], p.h2d_bytes_per_s),
                               (disk_w[w], secs[w] * p.nvme_write_bytes_per_s, p.nvme_write_bytes_per_s),
                               (disk_r[w], secs[w] * p.nvme_read_bytes_per_s, p.nvme_read_bytes_per_s)):
            if not vars_:
                continue
            slack = h.addVariable(lb=0)
            h.addConstr(sum(vars_) <= max(cap, 0.0) / float(GIB) + slack)
            cost = cost + slack * (float(GIB) / bw)
    h.minimize(cost)
    assert h.getModelStatus() == highspy.HighsModelStatus.kOptimal
    return float(h.getInfo().objective_function_value)


def plan_cost(p: ScheduleProblem, tiers: list[str]) -> float | None:
    """Objective of a tier assignment, or None if it breaks a budget or the span."""
    n, a = p.num_layers, p.activation_bytes
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    if any(e - s > p.max_recompute_span for s, e in zip(saved[:-1], saved[1:], strict=True)):
        return None
    for tier, budget in (("gpu", p.gpu_budget_bytes), ("cpu", p.cpu_budget_bytes), ("nvme", p.nvme_budget_bytes)):
        if sum(a[i] for i in range(n + 1) if tiers[i] == tier) > budget:
            return None
    cost = sum(sum(p.forward_seconds[s : e - 1]) for s, e in zip(saved[:-1], saved[1:], strict=True))
    for i in range(1, n):
        if tiers[i] != "recompute":
            cost += p.lambda_materialize
        cost += {"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(tiers[i], 0.0)
    return cost + transfer_cost(p, tiers)


def brute_force(p: ScheduleProblem) -> tuple[float, list[str]] | None:
    best = None
    for inner in itertools.product(("gpu", "cpu", "nvme", "recompute"), repeat=p.num_layers - 1):
        tiers = ["gpu", *inner, "gpu"]
        c = plan_cost(p, tiers)
        if c is not None and (best is None or c < best[0] - 1e-12):
            best = (c, tiers)
    return best


def random_problem(rng: random.Random, n: int) -> ScheduleProblem:
    """Small instances where transfers are tight, so homes, windows and recompute all compete."""
    a = [rng.randint(1, 4) * GIB // 4 for _ in range(n + 1)]
    total = sum(a)
    fwd = [rng.uniform(0.01, 0.05) for _ in range(n)]
    return ScheduleProblem(
        activation_bytes=a, forward_seconds=fwd, window_seconds=[3 * f * rng.uniform(0.5, 1.5) for f in fwd],
        param_h2d_bytes=[rng.randint(0, 3) * GIB // 8 for _ in range(n)],
        grad_d2h_bytes=[rng.randint(0, 3) * GIB // 8 for _ in range(n)],
        gpu_budget_bytes=a[0] + a[n] + int(rng.uniform(0, 0.5) * total),
        cpu_budget_bytes=int(rng.uniform(0, 0.4) * total), nvme_budget_bytes=int(rng.uniform(0.1, 0.8) * total),
        h2d_bytes_per_s=rng.uniform(2, 12) * GIB, d2h_bytes_per_s=rng.uniform(2, 12) * GIB,
        nvme_read_bytes_per_s=rng.uniform(1, 10) * GIB, nvme_write_bytes_per_s=rng.uniform(1, 10) * GIB,
        max_recompute_span=rng.randint(2, n), head_seconds=rng.choice([0.0, 0.02]),
        lambda_materialize=1e-5, lambda_cpu=1e-6, lambda_nvme=3e-6)


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
    assert plan_cost(p, s.tiers) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    ties = sum(p.lambda_materialize for t in s.tiers[1:-1] if t != "recompute")
    ties += sum({"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(t, 0.0) for t in s.tiers)
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
        assert sum(a[i] for i, t in enumerate(s.tiers) if t == tier) <= budget
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
    assert s.tiers == ["gpu", "gpu"] and s.predicted_exposed_seconds == 0 and s.blocks() == [(0, 1)]
