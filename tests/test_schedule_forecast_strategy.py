"""The forecast plans as the strategy does: the same problem as `planning.solve.solve_plan`, the same per-layer
estimates as `profile_model` off CUDA, and an admission GPU tier and batch search that agree with the MILP's memory
rows."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from helpers import VOCAB, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, Qwen2Config

from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.engine.executor import StreamingExecutor
from lightning_lazytrain.models.adapter import adapter_for
from lightning_lazytrain.planning import solve as planner
from lightning_lazytrain.schedule import profile_model
from lightning_lazytrain.schedule.analytic import ACHIEVED_FRACTION, analytic_profile, scale_profile
from lightning_lazytrain.schedule.batch_search import admits, largest_batch
from lightning_lazytrain.schedule.feasibility import some_plan_fits
from lightning_lazytrain.schedule.forecast import Machine, RunSpec, forecast, plan_inputs, problem_for
from lightning_lazytrain.schedule.gpus import GPUS
from lightning_lazytrain.schedule.milp import InfeasibleScheduleError, precheck, solve
from lightning_lazytrain.schedule.milp_memory import plan_gpu_bytes
from lightning_lazytrain.schedule.plan_inputs import PlanSettings, gpu_total_bytes
from lightning_lazytrain.schedule.problem import ScheduleProblem

GIB, MIB = 1 << 30, 1 << 20
H200 = GPUS["h200"]
# six layers of 512 hidden, 2048 intermediate, 8 heads of 64, 4 KV heads: at seq 1024 a boundary is 1 MiB per sequence
SIX = dict(vocab_size=512, hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=4)
SIX_SLOT = 2 * ((512 * 512 + 512) + 2 * (512 * 256 + 256) + 512 * 512 + 3 * 512 * 2048 + 2 * 512)
SIX_RESIDENT = 2 * (2 * 512 * 512 + 512)  # embeddings, head (untied), final norm, once in bf16
SIX_GRAPH = 1024 * (2 * (4 + 2) * 512 + 2 * 2 * 512 + 2 * (3 * 512 + 4 * 256 + 512) + 2 * 4 * 2048)  # a sequence's
SIX_MLP_GRAPH = 1024 * (2 * (4 + 2) * 512 + 2 * 2 * 512 + 2 * (3 * 512 + 4 * 256 + 512))  # without the MLP's own
HEAD = 3 * (1 << 29)  # three 512 MiB loss chunks (the executor's default), before the two hidden-state terms
SIX_HEAD_GRAD_SUM = 4 * 512 * 512  # the fp32 sum of the six-layer head's weight gradient: 1 MiB


def _six(**kw) -> RunSpec:
    with torch.device("meta"):
        adapter = adapter_for(AutoModelForCausalLM.from_config(Qwen2Config(**SIX), dtype=torch.bfloat16))
    return RunSpec(adapter, 1024, schedule="milp", **kw)


def _analytic(run: RunSpec):
    return lambda b: analytic_profile(run.adapter, b, run.seq, H200, run.stream_dtype)


def _machine_for_total(run: RunSpec, total: int) -> Machine:
    """A GPU whose memory gives the plan ``total`` bytes (up to the margin's rounding, checked)."""
    machine = Machine(replace(H200, memory_bytes=SIX_RESIDENT + math.ceil(total / 0.95)), 120 * GIB)
    assert total <= gpu_total_bytes(plan_inputs(run, machine)) <= total + 2
    return machine


def test_the_forecast_builds_the_problem_solve_plan_builds(monkeypatch):
    model = tiny_model("qwen2")
    adapter = adapter_for(model)
    executor = StreamingExecutor(adapter, torch.device("cpu"), torch.float32, torch.bfloat16, Schedule.every(4, 1))
    try:
        settings = PlanSettings("milp", keep_graph_layers=1, gpu_activation_gib=0.5, cpu_activation_gib=2.0,
                                        max_recompute_span=3, layer_micro_batches=2)
        run = RunSpec(adapter, 16, schedule="milp", keep_graph_layers=1, gpu_activation_gib=0.5,
                      cpu_activation_gib=2.0, max_recompute_span=3, layer_micro_batches=2)
        machine = Machine(replace(H200, memory_bytes=3 * GIB), 120 * GIB)
        # the device copy of embeddings, head and final norm the executor holds before the planner measures
        resident = 2 * (2 * VOCAB * 64 + 64)
        assert executor.resident_device_bytes == 2 * resident  # that copy, and its gradients to come
        assert gpu_total_bytes(plan_inputs(run, machine)) == int(0.95 * (3 * GIB - resident))
        profile = analytic_profile(adapter, 2, 16, H200)
        built = []
        monkeypatch.setattr(planner, "device_plan_bytes", lambda _: plan_inputs(run, machine).device_bytes)
        monkeypatch.setattr(planner, "solve", lambda problem, **_: built.append(problem) or Schedule.every(4, 1))
        planner.solve_plan(planner.executor_inputs(settings, executor), profile)
    finally:
        executor.close()
    (strategy,) = built
    assert strategy.to_dict() == problem_for(run, machine, profile).to_dict()
    assert strategy.gpu_budget_bytes == int(0.5 * GIB) and strategy.keep_graph_layers == [3]
    head_grad_sum = 4 * model.config.vocab_size * model.config.hidden_size  # fp32, from the head's forward on
    assert strategy.head_working_bytes == HEAD + 2 * 2 * 16 * 64 * 2 + head_grad_sum and strategy.fixed_slots == 2
    assert strategy.graph_bytes == profile.graph_bytes and strategy.mlp_seconds == profile.mlp_seconds
    assert strategy.working_bytes != profile.working_bytes  # two layer micro-batches


def test_analytic_profile_has_the_estimates_profile_model_uses_off_cuda(tmp_path):
    adapter = adapter_for(tiny_model("qwen2"))
    batch, seq, h, inter = 2, 16, 64, 128
    tokens, rate = batch * seq, H200.bf16_tflops * 1e12 * ACHIEVED_FRACTION
    ours = analytic_profile(adapter, batch, seq, H200)
    theirs = profile_model(adapter, batch, seq, torch.device("cpu"), cache_dir=str(tmp_path))
    # per token: two norms' fp32 inputs and bf16 outputs, two hidden states, q/k/v, rotated q/k, attention output,
    # then gate/up/act/product
    mlp_graph = tokens * (2 * (4 + 2) * h + 2 * 2 * h + 2 * (3 * h + 4 * 32 + h))
    graph = mlp_graph + tokens * 2 * 4 * inter
    working = graph + tokens * 2 * (2 * inter + 2 * h) + ours.param_bytes[0]
    assert ours.graph_bytes == theirs.graph_bytes == [graph] * 4
    assert ours.working_bytes == theirs.working_bytes == [working] * 4
    assert ours.mlp_graph_bytes == theirs.mlp_graph_bytes == [mlp_graph] * 4
    assert ours.mlp_seconds == pytest.approx([2 * 3 * h * inter * tokens / rate] * 4, rel=1e-12)
    scaled = scale_profile(ours, 989.0, GPUS["a100-80gb"])
    assert scaled.mlp_seconds[0] == pytest.approx(ours.mlp_seconds[0] * 989 / 312)


def test_a_mixed_model_gets_a_graph_estimate_per_layer_kind():
    with torch.device("meta"):
        adapter = adapter_for(AutoModelForCausalLM.from_config(tiny_config("qwen3.5"), dtype=torch.bfloat16))
    prof = analytic_profile(adapter, 1, 16, H200)
    kinds = dict(zip(adapter.layer_types(), prof.graph_bytes))
    assert len(kinds) == 2 and kinds["linear_attention"] != kinds["full_attention"]
    assert prof.graph_bytes == [kinds[t] for t in adapter.layer_types()]


def test_largest_batch_is_the_brute_force_largest():
    run = _six(layer_micro_batches=1)  # whole-batch layers: the working set limits the batch
    # 1.5 GiB of head working set, then 40 MiB per sequence of one layer's working set and 1 MiB per boundary
    machine = Machine(replace(H200, memory_bytes=2 * GIB), GIB // 2)
    best = largest_batch(run, machine, _analytic(run))
    fits = [forecast(run, machine, b, _analytic(run)).fits_gpu for b in range(1, 48)]
    brute = max(b for b, ok in zip(range(1, 48), fits) if ok)
    assert 10 < brute < 47
    assert best.batch == brute and best.fits_gpu
    # the cheap test answers as the MILP does at every batch, not only at the one the search settles on
    assert [admits(run, machine, b, _analytic(run)) for b in range(1, 48)] == fits


def test_auto_micro_batches_are_the_fewest_that_fit_and_the_batch_search_stays_exact():
    """``layer_micro_batches="auto"`` (the default) takes the fewest slices with which the forecast fits: where the
    whole batch's working set no longer fits, the batch goes on growing in slices until the boundaries fill the
    device. The cheap test stays monotone in the batch, so bisection still finds the brute-force largest."""
    from lightning_lazytrain.schedule.plan_problem import micro_batch_candidates

    auto, whole = _six(), _six(layer_micro_batches=1)
    machine = Machine(replace(H200, memory_bytes=2 * GIB), GIB // 2)
    fits = [admits(auto, machine, b, _analytic(auto)) for b in range(1, 130)]
    assert fits == sorted(fits, reverse=True)
    best, whole_best = largest_batch(auto, machine, _analytic(auto)), largest_batch(whole, machine, _analytic(whole))
    assert best.batch == sum(fits) > whole_best.batch + 10 and best.fits_gpu
    for batch in (1, whole_best.batch, whole_best.batch + 1, best.batch):
        chosen = forecast(auto, machine, batch, _analytic(auto)).schedule.micro_batches
        fixed = [k for k in micro_batch_candidates(batch)
                 if forecast(_six(layer_micro_batches=k), machine, batch, _analytic(auto)).fits_gpu]
        assert chosen == fixed[0], (batch, chosen, fixed)
    assert forecast(auto, machine, whole_best.batch + 1, _analytic(auto)).schedule.micro_batches > 1


@pytest.mark.parametrize("memory_gib", [1.8, 2.0, 2.5])
def test_every_admitted_batch_has_a_plan_within_the_device_total(memory_gib):
    run = _six()
    machine = Machine(replace(H200, memory_bytes=int(memory_gib * GIB)), int(0.5 * GIB))
    total = gpu_total_bytes(plan_inputs(run, machine))
    best = largest_batch(run, machine, _analytic(run))
    for batch in (1, best.batch // 2, best.batch, best.batch + 1):
        f = forecast(run, machine, batch, _analytic(run))
        assert admits(run, machine, batch, _analytic(run)) == (f.schedule is not None) == (batch <= best.batch)
        if f.schedule is None:
            continue
        charged = plan_gpu_bytes(problem_for(run, machine, _analytic(run)(batch)),
                                 f.schedule.homes, f.schedule.keep_graph, f.schedule.mlp_recompute)
        gpu = f.report.tiers["gpu"]
        # the tier is the MILP's device row: the resident copy and the margin outside it, the plan's bytes inside
        assert charged <= total and gpu.need == machine.gpu.memory_bytes - total + charged <= gpu.have
        assert gpu.pieces["resident parts"] == SIX_RESIDENT


def test_kept_graphs_appear_when_memory_allows_and_vanish_when_tight():
    """Batch 1: the head's 1.5 GiB is the peak (with its two hidden states, its 1 MiB gradient sum and the 1 MiB of
    the backward's first input coming back), so the smallest plan holds the two ends and the two prefetch slots
    beside it, and every boundary on the GPU adds 1 MiB. A kept graph adds its bytes and a slot (a graph whose MLP
    re-runs, fewer bytes). Below the room for the smaller graph nothing is kept; with every boundary on the GPU
    and room for one graph of either kind, the whole graph (no re-run at all) wins, else the MLP-re-run one."""
    run = _six()
    smallest = 2 * MIB + 2 * SIX_SLOT + HEAD + 2 * MIB + SIX_HEAD_GRAD_SUM + MIB
    every_boundary = smallest + 5 * MIB
    assert analytic_profile(run.adapter, 1, 1024, H200).graph_bytes[0] == SIX_GRAPH

    def kept(total: int) -> tuple[int, int, dict]:
        f = forecast(run, _machine_for_total(run, total), 1, _analytic(run))
        return sum(f.schedule.keep_graph), sum(f.schedule.mlp_recompute), f.report.tiers["gpu"].pieces

    graphs, partial, pieces = kept(smallest + SIX_MLP_GRAPH + SIX_SLOT - MIB)
    assert (graphs, partial, pieces["weight slots"]) == (0, 0, 2 * SIX_SLOT) and "kept graphs" not in pieces
    graphs, partial, pieces = kept(every_boundary + SIX_MLP_GRAPH + SIX_SLOT + MIB)
    assert (graphs, partial, pieces["kept graphs"]) == (1, 1, SIX_MLP_GRAPH)
    graphs, partial, pieces = kept(every_boundary + SIX_GRAPH + SIX_SLOT + MIB)
    assert (graphs, partial, pieces["kept graphs"], pieces["weight slots"]) == (1, 0, SIX_GRAPH, 3 * SIX_SLOT)
    # an H200's memory keeps every layer's graph
    graphs, partial, pieces = kept(100 * GIB)
    assert (graphs, partial, pieces["kept graphs"]) == (6, 0, 6 * SIX_GRAPH)


def _uniform(n: int, size: int, slot: int, **kw) -> ScheduleProblem:
    """A problem of ``n`` equal layers: 10 ms forwards, streamed and written back over a 50 GB/s link."""
    return ScheduleProblem(
        activation_bytes=[size] * (n + 1), forward_seconds=[0.01] * n, window_seconds=[0.04] * n,
        param_h2d_bytes=[2 * slot] * n, grad_d2h_bytes=[slot] * n, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9,
        nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9, slot_bytes=slot, fixed_slots=2,
        mlp_graph_bytes=[GIB // 8] * n, mlp_seconds=[0.005] * n, **kw,
    )


def test_the_cheap_test_agrees_with_the_milp_on_random_problems():
    """Equal boundaries and working sets, up to two forced graphs anywhere, every budget and the device total
    drawn small enough that about half of the problems have no plan: `some_plan_fits` says so exactly when the
    MILP does."""
    rng = random.Random(0)
    answers = {True: 0, False: 0}
    for _ in range(150):
        n, size = rng.randint(2, 8), rng.randint(1, 4) * GIB // 8
        p = _uniform(
            n, size, rng.randint(1, 4) * GIB // 16, gpu_budget_bytes=rng.randint(2, 12) * size,
            cpu_budget_bytes=rng.randint(0, 4) * size, nvme_budget_bytes=rng.randint(0, 2) * size,
            max_recompute_span=rng.randint(1, 4), graph_bytes=[rng.randint(1, 3) * GIB // 4] * n,
            working_bytes=[rng.randint(0, 8) * GIB // 8] * n, head_working_bytes=rng.randint(0, 3) * GIB // 2,
            gpu_total_bytes=rng.randint(2, 24) * GIB // 4, keep_graph_layers=rng.sample(range(n), rng.randint(0, 2)),
        )
        try:
            precheck(p)
            cheap = some_plan_fits(p)
        except InfeasibleScheduleError:
            cheap = False
        try:
            solve(p, time_limit=5.0)
            solved = True
        except InfeasibleScheduleError:
            solved = False
        assert cheap == solved, p
        answers[solved] += 1
    assert min(answers.values()) >= 50  # both answers well represented


def test_a_forced_graphs_output_needs_a_home():
    """Layer 0 keeps its graph: boundary 1, its output, is saved. The GPU budget holds the two ends and the graph
    only and no other home has room for a whole boundary (half of one on the CPU), so no plan fits."""
    size, graph = GIB // 4, GIB // 2
    tight = _uniform(3, size, GIB // 16, gpu_budget_bytes=2 * size + graph, cpu_budget_bytes=size // 2,
                     nvme_budget_bytes=0, max_recompute_span=2, graph_bytes=[graph] * 3, working_bytes=[0] * 3,
                     gpu_total_bytes=8 * GIB, keep_graph_layers=[0])
    assert not some_plan_fits(tight)
    assert some_plan_fits(replace(tight, cpu_budget_bytes=size))
    with pytest.raises(InfeasibleScheduleError):
        solve(tight)
    assert solve(replace(tight, cpu_budget_bytes=size)).homes[1] == "cpu"
