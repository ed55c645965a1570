import time
from dataclasses import replace

import pytest

from lightning_lazytrain.schedule import ScheduleProblem, solve

GIB = 1 << 30


def hard_64_layer_problem(span: int = 16) -> ScheduleProblem:
    """27B-shaped (hidden 5120, batch 16 x 1024) with a small GPU budget: the slowest case of the benchmark sweep."""
    n, act, params = 64, 16 * 1024 * 5120 * 2, 350.2e6
    fwd = [2 * params * 16 * 1024 / 400e12 * (1.0 + 0.02 * ((j * 7) % 5)) for j in range(n)]
    total = act * (n + 1)
    return ScheduleProblem(
        activation_bytes=[act] * (n + 1), forward_seconds=fwd, window_seconds=[3 * f for f in fwd],
        param_h2d_bytes=[int(4 * params)] * n, grad_d2h_bytes=[int(2 * params)] * n,
        gpu_budget_bytes=int(0.1 * total), cpu_budget_bytes=int(0.4 * total), nvme_budget_bytes=int(0.4 * total),
        h2d_bytes_per_s=55e9, d2h_bytes_per_s=55e9, nvme_read_bytes_per_s=1.28e9, nvme_write_bytes_per_s=0.51e9,
        max_recompute_span=span)


def test_time_limit_honoured():
    p = hard_64_layer_problem()
    t0 = time.perf_counter()
    try:
        s = solve(p, time_limit=1.5, mip_gap=1e-9)
    except RuntimeError as e:  # no incumbent yet is a legitimate outcome of a very short limit
        assert "no plan" in str(e)
    else:
        assert s.status in ("time_limit", "optimal")
    # the slack covers the model build and a loaded 2-core CI machine (2.52 s was seen there); the problem at
    # this gap runs far longer than 5.5 s without the limit
    assert time.perf_counter() - t0 < 1.5 + 4.0


def test_gap_honoured_and_reported():
    s = solve(hard_64_layer_problem(span=4), time_limit=30, mip_gap=0.05)
    assert s.status == "optimal" and s.info["mip_gap"] <= 0.05 + 1e-9
    assert s.info["num_binaries"] > 0 and s.info["solve_seconds"] < 30


@pytest.mark.parametrize("head", [0.0, 1.0])
def test_head_window_hides_last_reloads(head):
    # 2 layers, boundary 1 can only live on the CPU; its block (1, 2) ends at L, so only the head window can hide
    # the reload. With no head time it is fully exposed: A / B_H seconds.
    p = ScheduleProblem(
        activation_bytes=[GIB, GIB, GIB], forward_seconds=[10.0, 10.0], window_seconds=[30.0, 30.0],
        param_h2d_bytes=[0, 0], grad_d2h_bytes=[0, 0], gpu_budget_bytes=2 * GIB, cpu_budget_bytes=GIB,
        nvme_budget_bytes=0, h2d_bytes_per_s=GIB, d2h_bytes_per_s=GIB, nvme_read_bytes_per_s=GIB,
        nvme_write_bytes_per_s=GIB, max_recompute_span=1, head_seconds=head)
    s = solve(p, mip_gap=1e-9)
    assert s.homes == ["gpu", "cpu", "gpu"]
    assert s.predicted_exposed_seconds == pytest.approx(1.0 - head, abs=1e-6)


def test_layer_choice_milp_solves_64_layers_at_1pct_gap():
    """P6: per-layer kept graphs, slots and working sets on top of the hardest 64-layer case (span 16). Measured
    4.8 s (1.2 s of it building the model) on the 2-core machine at load 5; the target is 10 s on 2 cores."""
    p = hard_64_layer_problem(span=16)
    act, slot = p.activation_bytes[0], int(2 * 350.2e6)
    graph, work = 36 * act, 48 * act + slot
    p = replace(p, graph_bytes=[graph] * 64, working_bytes=[work] * 64, slot_bytes=slot, fixed_slots=2,
                head_working_bytes=3 * (1 << 29) + 2 * act, gpu_budget_bytes=p.gpu_budget_bytes + 6 * graph,
                gpu_total_bytes=p.gpu_budget_bytes + 6 * slot + work + 6 * (graph + slot))
    t0 = time.perf_counter()
    s = solve(p, time_limit=60, mip_gap=0.01)
    elapsed = time.perf_counter() - t0
    assert s.status == "optimal" and s.info["mip_gap"] <= 0.01
    assert 0 < sum(s.keep_graph) < 64 and s.info["gpu_bytes"] <= p.gpu_total_bytes
    assert elapsed < 30.0  # 3x the target: the CI machine's 2 cores are shared


def test_the_p6_benchmark_builds_the_planners_problem():
    """``benchmarks/milp_solve_2core.py`` builds its 64-layer problems with ``plan_problem``; a new argument of that
    function (138dea7) broke the script with a TypeError, and no test ran it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "milp_solve_2core.py"
    spec = importlib.util.spec_from_file_location("milp_solve_2core", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from lightning_lazytrain.models.adapter import adapter_for
    from lightning_lazytrain.sft.plan_model import _named, meta_model

    adapter = adapter_for(meta_model(_named(bench.SHAPE)))
    batch, cap, cpu, nvme, span = bench.CASES["b16-cap40"]
    p = bench.problem_for(adapter, batch, cap, cpu, nvme, span)
    assert p.num_layers == 64 and p.head_working_bytes > 4 * adapter.lm_head.weight.numel()
