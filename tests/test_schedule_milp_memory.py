"""The MILP with kept graphs, weight slots and working sets against brute force over every plan.

Reference: every tier assignment x every set of layers keeping their graph, memory counted from the step's
timeline here (not from `milp_memory.py`), transfers placed by the LP of `test_schedule_milp.transfer_cost` over
windows shrunk for the kept layers.
"""

import dataclasses
import itertools
import random

import pytest
from test_schedule_milp import GIB, random_problem, transfer_cost

from lightning_lazytrain.schedule import InfeasibleScheduleError, ScheduleProblem, solve


def gpu_peak(p: ScheduleProblem, tiers: list[str], keep: tuple[bool, ...]) -> int:
    """Largest GPU use over the backward: everything saved and every held graph, plus the running block's slots,
    rebuilt boundaries and largest working set (or the head's working set). Beside those, while a block runs the
    layer above's gradients are still being copied out (one slot's bytes), and, where boundaries may leave the GPU,
    its input and the next block's may both be on the GPU on their way back: two of the largest inner boundary."""
    n, a = p.num_layers, p.activation_bytes
    held = sum(a[i] for i in range(n + 1) if tiers[i] == "gpu")
    held += sum(p.graph_bytes[j] + p.slot_bytes for j in range(n) if keep[j]) + p.fixed_slots * p.slot_bytes
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    offload = p.cpu_budget_bytes + p.nvme_budget_bytes > 0
    peaks = [p.head_working_bytes + (max(a[1:n], default=0) if offload else 0)]  # the first reload starts there
    for s, e in zip(saved[:-1], saved[1:], strict=True):
        block = (e - s) * p.slot_bytes + sum(a[s + 1 : e]) + max(p.working_bytes[s:e])
        copying_out = p.slot_bytes
        brought_back = 2 * max(a[1:n], default=0) if offload else 0
        peaks.append(block + copying_out + brought_back)
    return held + max(peaks)


def plan_cost(p: ScheduleProblem, tiers: list[str], keep: tuple[bool, ...]) -> float | None:
    n, a = p.num_layers, p.activation_bytes
    saved = [i for i, t in enumerate(tiers) if t != "recompute"]
    blocks = list(zip(saved[:-1], saved[1:], strict=True))
    if any(e - s > p.max_recompute_span for s, e in blocks):
        return None
    if any(keep[j] and ((j, j + 1) not in blocks or tiers[j] != "gpu") for j in range(n)):
        return None
    if any(not keep[j] for j in p.keep_graph_layers):
        return None
    graphs = sum(p.graph_bytes[j] for j in range(n) if keep[j])
    for tier, budget, extra in (
        ("gpu", p.gpu_budget_bytes, graphs),
        ("cpu", p.cpu_budget_bytes, 0),
        ("nvme", p.nvme_budget_bytes, 0),
    ):
        if sum(a[i] for i in range(n + 1) if tiers[i] == tier) + extra > budget:
            return None
    if gpu_peak(p, tiers, keep) > p.gpu_total_bytes:
        return None
    cost = sum(sum(p.forward_seconds[s : e - 1]) for s, e in blocks)
    cost += sum(p.reruns[j] for j in range(n) if not keep[j])  # the backward's re-run of each layer
    for i in range(1, n):
        cost += p.lambda_materialize if tiers[i] != "recompute" else 0.0
        cost += {"cpu": p.lambda_cpu, "nvme": p.lambda_nvme}.get(tiers[i], 0.0)
    shrunk = dataclasses.replace(
        p,
        window_seconds=[w - (p.reruns[j] if keep[j] else 0.0) for j, w in enumerate(p.window_seconds)],
        param_h2d_bytes=[b // 2 if keep[j] else b for j, b in enumerate(p.param_h2d_bytes)],
    )
    return cost + transfer_cost(shrunk, tiers)


def brute_force(p: ScheduleProblem):
    best = None
    for inner in itertools.product(("gpu", "cpu", "nvme", "recompute"), repeat=p.num_layers - 1):
        tiers = ["gpu", *inner, "gpu"]
        for keep in itertools.product((False, True), repeat=p.num_layers):
            c = plan_cost(p, tiers, keep)
            if c is not None and (best is None or c < best[0] - 1e-12):
                best = (c, tiers, keep)
    return best


def memory_problem(seed: int) -> ScheduleProblem:
    rng = random.Random(1000 + seed)
    n = 3 + seed % 2
    p = random_problem(rng, n)
    graph = [rng.randint(1, 4) * GIB // 8 for _ in range(n)]
    work = [rng.randint(1, 6) * GIB // 4 for _ in range(n)]
    slot = rng.choice([0, GIB // 8])
    total = sum(p.activation_bytes) + sum(graph) // 2 + max(work) + 3 * slot
    return dataclasses.replace(
        p,
        graph_bytes=graph,
        working_bytes=work,
        head_working_bytes=rng.randint(0, 4) * GIB // 4,
        slot_bytes=slot,
        fixed_slots=1,
        gpu_total_bytes=int(total * rng.uniform(0.7, 1.3)),
        gpu_budget_bytes=p.gpu_budget_bytes + rng.randint(0, 3) * GIB // 2,
        keep_graph_layers=[n - 1] if seed % 4 == 3 else [],
        # the re-run skips the MLP's output projection: a share of the forward, drawn last so the rest stays as it was
        rerun_seconds=[f * rng.uniform(0.6, 1.0) for f in p.forward_seconds],
    )


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
    assert plan_cost(p, s.tiers, tuple(s.keep_graph)) == pytest.approx(ref[0], rel=1e-6, abs=1e-9)
    assert s.info["gpu_bytes"] == gpu_peak(p, s.tiers, tuple(s.keep_graph)) <= p.gpu_total_bytes
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
