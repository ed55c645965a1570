"""Layers run in row micro-batches (``layer_micro_batches``, ``Schedule.micro_batches``): each layer sees slices of
the batch, its weight gradients are summed, and the run trains like the one without micro-batches and like plain
Lightning, masks, kept graphs, MLP re-runs and dropout included."""

import dataclasses
import json

import pytest
import torch
from helpers import FAMILIES, GradRecorder, batches, rel_diff, tiny_model, train
from test_strategy_dropout import _grad_rel_diff

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine import Schedule
from lightning_lazytrain.engine.compute.micro_batches import SummedGrads, row_slices, split_call
from lightning_lazytrain.schedule.plan_inputs import PlanSettings


def test_row_slices_cover_the_batch_evenly_and_never_empty():
    assert row_slices(4, 1) == [slice(0, 4)]
    assert row_slices(4, 3) == [slice(0, 1), slice(1, 2), slice(2, 4)]
    assert row_slices(2, 8) == [slice(0, 1), slice(1, 2)]
    for rows in range(1, 9):
        for k in range(1, 10):
            parts = row_slices(rows, k)
            assert len(parts) == min(rows, k) and all(p.stop > p.start for p in parts)
            assert [p.start for p in parts[1:]] == [p.stop for p in parts[:-1]] and parts[-1].stop == rows


def test_a_call_is_sliced_where_its_first_dimension_is_the_batch():
    rows, part = 4, slice(1, 3)
    mask, pos, shared, cache_position = torch.ones(4, 1, 8, 8), torch.arange(32).view(4, 8), torch.ones(1, 8, 2), \
        torch.arange(8)
    args, kwargs = split_call((mask,), {"position_embeddings": (pos, shared), "cache_position": cache_position,
                                        "use_cache": False, "nested": [{"m": mask}]}, rows, part)
    assert args[0].shape == (2, 1, 8, 8)
    assert torch.equal(kwargs["position_embeddings"][0], pos[1:3]) and kwargs["position_embeddings"][1] is shared
    assert kwargs["cache_position"] is cache_position and kwargs["use_cache"] is False
    assert kwargs["nested"][0]["m"].shape == (2, 1, 8, 8)
    whole = split_call((mask,), {}, rows, slice(0, rows))
    assert whole[0][0] is mask


def test_a_batch_shaped_argument_that_is_no_tensor_is_refused_by_name():
    class BlockMask:  # flex attention's mask: one entry per row, not a tensor
        shape = (4, 1, 8, 8)

    with pytest.raises(ValueError, match="cannot slice the decoder layer's BlockMask argument"):
        split_call((), {"attention_mask": BlockMask()}, 4, slice(0, 2))


def test_summed_grads_add_in_place_and_replace_a_broadcast_gradient():
    a, b = torch.ones(3), torch.full((3,), 2.0)
    broadcast = torch.zeros(1).expand(3)
    summed = SummedGrads()
    summed.add([a, broadcast, None])
    summed.add([b, torch.ones(3), torch.ones(3)])
    assert summed.total[0] is a and torch.equal(a, torch.full((3,), 3.0))
    assert torch.equal(summed.total[1], torch.ones(3)) and torch.equal(summed.total[2], torch.ones(3))


def _rows_seen(model) -> list[int]:
    """The rows of every call of layer 1's MLP (forward, re-runs and MLP re-runs alike)."""
    seen = []
    model.model.layers[1].mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_micro_batches_train_like_the_whole_batch(family):
    """Batch 4 in 3 slices (1, 1, 2 rows), padded rows, a plan with re-runs and a kept graph: the weights after two
    steps match the run without micro-batches within float rounding, and layer 1 saw only slices."""
    model, data = tiny_model(family), batches(2, batch=4, padded=True)
    ref, _ = train(model, data, max_steps=2)
    whole, _ = train(model, data, max_steps=2, strategy=LazyTrainStrategy(schedule="interval:2", keep_graph_layers=1))
    sliced_model = tiny_model(family)
    seen = _rows_seen(sliced_model)
    sliced, _ = train(sliced_model, data, max_steps=2,
                      strategy=LazyTrainStrategy(schedule="interval:2", keep_graph_layers=1, layer_micro_batches=3))
    assert seen and set(seen) == {1, 2}
    assert rel_diff(sliced.model, whole.model) <= 1e-6
    assert rel_diff(sliced.model, ref.model) <= 5e-6
    assert sliced.losses == pytest.approx(whole.losses, rel=1e-6)


def test_micro_batches_with_mlp_recompute_and_host_homes(tmp_path):
    """A plan file with a CPU home, a kept graph whose MLP re-runs and two micro-batches trains like plain."""
    model, data = tiny_model("qwen2"), batches(2, batch=4, padded=True)
    ref, _ = train(model, data, max_steps=2)
    n = model.config.num_hidden_layers
    plan = Schedule(["gpu", "cpu", "recompute"] + ["gpu"] * (n - 2), keep_graph=[False] * (n - 1) + [True],
                    mlp_recompute=[False] * (n - 1) + [True], micro_batches=2)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    assert json.loads(path.read_text())["micro_batches"] == 2
    lt, _ = train(model, data, max_steps=2, strategy=LazyTrainStrategy(schedule=str(path)))
    assert rel_diff(lt.model, ref.model) <= 5e-6


def test_dropout_masks_are_replayed_per_micro_batch():
    """With dropout, a plan that re-runs every layer in the backward gives the gradients of one that keeps every
    graph (no re-run), both in two micro-batches: each slice's re-run draws the masks its forward drew."""
    model, data = tiny_model("qwen2", attention_dropout=0.3), batches(2, batch=4)
    model.set_attn_implementation("eager")
    n = model.config.num_hidden_layers
    runs = {}
    for name, schedule, kept in (("kept", "interval:1", n), ("rerun", "interval:3", 0), ("other", "interval:1", n)):
        torch.manual_seed(99 if name == "other" else 1234)
        recorder = GradRecorder()
        strategy = LazyTrainStrategy(schedule=schedule, keep_graph_layers=kept, layer_micro_batches=2)
        train(model, data, max_steps=2, strategy=strategy, callbacks=[recorder])
        runs[name] = recorder
    assert _grad_rel_diff(runs["other"], runs["kept"]) > 1e-2, "the dropout masks must matter"
    assert _grad_rel_diff(runs["rerun"], runs["kept"]) <= 1e-6


def test_plan_and_settings_carry_micro_batches(tmp_path):
    from lightning_lazytrain.planning.solve import initial_plan

    plan = Schedule.every(4, 2)
    assert plan.micro_batches == 1
    again = Schedule.from_json(Schedule(plan.homes, micro_batches=4).to_json())
    assert again.micro_batches == 4 and not again.same_placement(plan)
    with pytest.raises(ValueError, match="micro_batches must be an integer >= 1"):
        Schedule(plan.homes, micro_batches=0)
    for wrong in (0, "fewest", True):
        with pytest.raises(ValueError, match=f"layer_micro_batches={wrong!r}.*or 'auto'"):
            PlanSettings(layer_micro_batches=wrong)
    assert initial_plan(PlanSettings(schedule="interval:2"), 4).micro_batches == 1  # "auto": the MILP's choice
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())

    with pytest.raises(ValueError, match="set its 'micro_batches' there"):
        initial_plan(PlanSettings(schedule=str(path), layer_micro_batches=2), 4)
    assert initial_plan(PlanSettings(schedule="interval:2", layer_micro_batches=3), 4).micro_batches == 3


def test_the_milp_plans_the_micro_batch_working_set():
    """A layer whose working set (8 GiB, 1 GiB of it weight gradients) cannot fit 6 GiB fits in two micro-batches:
    3.5 GiB of per-token bytes, two sets of weight gradients and one boundary (1 MiB)."""
    from lightning_lazytrain.schedule import InfeasibleScheduleError, Profile, solve
    from lightning_lazytrain.schedule.plan_problem import plan_problem
    from lightning_lazytrain.units import GIB

    n = 3
    profile = Profile(forward_seconds=[0.01] * n, activation_bytes=[1 << 20] * (n + 1), param_bytes=[GIB] * n,
                      head_seconds=0.01, h2d_bytes_per_s=50e9, d2h_bytes_per_s=50e9, duplex_bytes_per_s=100e9,
                      nvme_read_bytes_per_s=1e9, nvme_write_bytes_per_s=1e9, device_name="x",
                      sources=dict.fromkeys(("forward_seconds", "head_seconds", "h2d", "d2h", "duplex", "nvme_read",
                                             "nvme_write"), "analytic"),
                      graph_bytes=[GIB] * n, working_bytes=[8 * GIB] * n, dtype="bfloat16", batch=4)

    def problem(micro_batches: int | str, total: int = 6 * GIB):
        return plan_problem(profile, 6 * GIB, GIB, 0, total_bytes=total, slot_bytes=GIB // 10, prefetch_depth=1,
                            loss_chunk_bytes=1 << 20, head_grad_bytes=0, max_recompute_span=2, keep_graph_layers=0,
                            micro_batches=micro_batches)

    with pytest.raises(InfeasibleScheduleError, match=r"working set.*layer_micro_batches"):
        solve(problem(1))
    assert problem(2).working_bytes == [7 * GIB // 2 + 2 * GIB + (1 << 20)] * n
    assert problem(4).working_bytes == [7 * GIB // 4 + 2 * GIB + (1 << 20)] * n
    assert solve(problem(2)).micro_batches == 2  # the plan runs what its problem counted
    assert problem("auto") == problem(2)  # the fewest slices with which a plan fits
    assert problem("auto", total=10 * GIB) == problem(1, total=10 * GIB)
    # none fits: the most slices, whose refusal is what is left after slicing
    assert problem("auto", total=3 * GIB) == problem(4, total=3 * GIB)
    with pytest.raises(InfeasibleScheduleError, match="working set in 4 row slices with its slots"):
        solve(problem("auto", total=3 * GIB))
    unprofiled = plan_problem(dataclasses.replace(profile, working_bytes=[]), 6 * GIB, GIB, 0, total_bytes=1 << 20,
                              slot_bytes=GIB // 10, prefetch_depth=1, loss_chunk_bytes=1 << 20, head_grad_bytes=0,
                              max_recompute_span=2, keep_graph_layers=0, micro_batches="auto")
    assert unprofiled.micro_batches == 1  # nothing fits, but with no working set to divide slices would only slow it
    profile.batch = 2  # the engine never cuts a batch into more slices than it has rows
    assert problem(4).working_bytes == problem(2).working_bytes


def test_an_milp_run_in_micro_batches_trains_like_plain():
    model, data = tiny_model("qwen3"), batches(2, batch=4, padded=True)
    ref, _ = train(model, data, max_steps=2)
    strategy = LazyTrainStrategy(schedule="milp", layer_micro_batches=2)
    lt, _ = train(model, data, max_steps=2, strategy=strategy)
    assert strategy.schedule_result.micro_batches == 2
    assert rel_diff(lt.model, ref.model) <= 5e-6
