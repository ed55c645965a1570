"""The out-of-memory fallback ladder: an OOM injected in the first steps (torch.OutOfMemoryError raised from a
forward hook inside a decoder layer) walks the rungs in order, and training continues with a plain run's numbers."""

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import batches, rel_diff, tiny_model, train
from test_engine_updates import HybridModule

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.faults import GpuMemoryError
from lightning_lazytrain.planning import RUNGS


def _failing(model, failures: int) -> dict:
    """Make the first ``failures`` calls of layer 1's MLP raise an OOM (a closure: deepcopy keeps the counter)."""
    left = {"n": failures}

    def hook(module, args):
        if left["n"] > 0:
            left["n"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.model.layers[1].mlp.register_forward_pre_hook(hook)
    return left


@pytest.mark.parametrize("module_cls", [None, HybridModule], ids=["torch-adamw", "engine-updates"])
def test_four_ooms_walk_the_rungs_and_training_matches_plain(caplog, tmp_path, module_cls):
    model, data = tiny_model("qwen2"), batches(3)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"), module_cls=module_cls)
    failing = tiny_model("qwen2")
    left = _failing(failing, 4)
    strategy = LazyTrainStrategy(schedule="interval:1", keep_graph_layers=2, spill_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain.planning"):
        lt, trainer = train(failing, data, strategy=strategy, module_cls=module_cls)
    assert left["n"] == 0 and strategy.run_plan.ladder.taken == list(RUNGS)
    rungs = [r.getMessage() for r in caplog.records if "fallback rung" in r.getMessage()]
    assert [m.split("(")[1].split(")")[0] for m in rungs] == list(RUNGS), rungs
    assert all(m.endswith("it failed at: CUDA out of memory. Tried to allocate 2.00 GiB") for m in rungs), rungs
    assert strategy.schedule_result is None  # an interval plan: nothing MILP-planned for checkpoints to carry
    assert strategy.executor is None and strategy.run_plan.settings.layer_micro_batches == 2  # batch 2: one row a slice
    assert rel_diff(lt.model, ref.model) <= 1e-6
    assert trainer.global_step == 3


def test_last_rung_plan_is_the_expected_one():
    from lightning_lazytrain.engine import Schedule
    from lightning_lazytrain.planning import OomLadder

    ladder, plan, seen = OomLadder(), Schedule.every(4, 1, 2), []
    while (plan := ladder.next_plan(plan, "/spill", None) or None) is not None:
        seen.append((tuple(plan.homes), tuple(plan.keep_graph)))
    assert seen == [
        (("gpu",) * 5, (False,) * 4),
        (("gpu", "recompute", "gpu", "recompute", "gpu"), (False,) * 4),
        (("gpu", "recompute", "cpu", "recompute", "gpu"), (False,) * 4),
    ]  # no rows: the micro-batch rung cannot split the batch


def test_the_micro_batch_rung_doubles_until_a_slice_is_one_row():
    from lightning_lazytrain.engine import Schedule
    from lightning_lazytrain.planning import OomLadder

    ladder, plan = OomLadder(rung=3), Schedule(["gpu", "cpu", "gpu"], keep_graph=[False, True])
    seen = []
    while (plan := ladder.next_plan(plan, None, None, rows=6)) is not None:
        seen.append(plan.micro_batches)
        assert plan.homes == ["gpu", "cpu", "gpu"] and plan.keep_graph == [False, True]
    assert seen == [2, 4, 6] and ladder.taken == [RUNGS[3]] * 3
    assert not ladder.applies(0, 1)


def test_ooms_past_the_last_rung_stop_with_todays_message():
    model = tiny_model("qwen2")
    _failing(model, 100)
    strategy = LazyTrainStrategy(schedule="interval:1")
    with pytest.raises(GpuMemoryError, match="out of memory inside a training step") as err:
        train(model, batches(2), strategy=strategy)
    assert "a smaller batch with accumulate_grad_batches" in str(err.value)
    assert "layers in 2 row slices" in str(err.value)  # the plan that ran out last: one row a slice
    # no graphs to drop: rung 1 skipped; batch 2: one micro-batch rung, then a slice is one row
    assert strategy.run_plan.ladder.taken == ["more recompute", "CPU/NVMe homes", "smaller layer micro-batches"]


def test_no_fallback_after_the_first_steps():
    model = tiny_model("qwen2")
    _failing(model, 1)
    strategy = LazyTrainStrategy(schedule="interval:1", oom_fallback_steps=0)
    with pytest.raises(GpuMemoryError):
        train(model, batches(2), strategy=strategy)
    assert strategy.run_plan.ladder.taken == []


def test_the_rung_is_planned_after_the_failed_step_has_let_go_of_its_tensors(monkeypatch):
    """An MILP rung budgets from the device memory free when it is solved: by then the failed step's tensors must
    be gone (on the H100 a re-plan read inside the except block saw 4.9 of 79 GiB free and refused every plan)."""
    import weakref

    import lightning_lazytrain.planning.run_plan as run_plan

    model, alive_at_budget = tiny_model("qwen2"), []
    left = {"n": 1}

    def hook(module, args):
        if left["n"] > 0:
            left["n"] -= 1
            left["input"] = weakref.ref(args[0])  # held only by the failing step's frames
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.model.layers[1].mlp.register_forward_pre_hook(hook)
    budgets = run_plan.budgets

    def spy(inputs):
        if "input" in left:
            alive_at_budget.append(left["input"]() is not None)
        return budgets(inputs)

    monkeypatch.setattr(run_plan, "budgets", spy)
    strategy = LazyTrainStrategy(schedule="milp")
    rung_plans, next_plan = [], strategy.run_plan.ladder.next_plan
    strategy.run_plan.ladder.next_plan = lambda *a: rung_plans.append(next_plan(*a)) or rung_plans[-1]
    train(model, batches(2), strategy=strategy)
    assert left["n"] == 0 and strategy.run_plan.ladder.taken  # the step failed once and a rung was taken
    assert alive_at_budget and not any(alive_at_budget), "a rung was budgeted while the failed step's tensors lived"
    # checkpoints save the plan that ran after the fallback, not the one that ran out of memory
    assert rung_plans and strategy.schedule_result is rung_plans[-1]


def test_the_device_total_after_a_discarded_step_counts_no_slot_pool(monkeypatch):
    """A failed step is discarded before its rung is planned, which drops the slot pool: the plan's device total
    is then what is free (the pool's memory is in it), not an error for want of a pool to add back."""
    from types import SimpleNamespace

    from lightning_lazytrain.planning import solve

    monkeypatch.setattr(solve, "device_free_bytes", lambda device: 10_000)
    store = SimpleNamespace(stream_dtype=torch.bfloat16)
    executor = SimpleNamespace(device=torch.device("cuda"), slot_numel=100, store=store,
                               device_update_reserve_bytes=500, pool=SimpleNamespace(slots=[object()] * 3))
    assert solve.device_plan_bytes(executor) == 10_000 + 3 * 200 - 500
    executor.pool = None
    assert solve.device_plan_bytes(executor) == 10_000 - 500


def _whole_batch_fails(model) -> None:
    """Layer 1's MLP runs out of memory on any call of more than one row: only one-row slices fit."""
    def hook(module, args):
        if args[0].shape[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.model.layers[1].mlp.register_forward_pre_hook(hook)


@pytest.mark.parametrize("schedule", ["interval:1", "milp"])
def test_a_run_resumed_past_the_ladders_steps_starts_on_the_plan_that_fit(tmp_path, schedule):
    """Saved at step 2 after the ladder reached one-row slices, resumed where the ladder no longer acts: the
    resumed run must start on those slices (on the whole batch it stops with an OOM), and ends like plain."""
    import lightning.pytorch as pl
    from helpers import LMModule, loader

    data = batches(1) * 4  # one batch repeated: a resumed loader starting over sees the same data
    ref, _ = train(tiny_model("qwen2"), data, max_steps=4)
    model = tiny_model("qwen2")
    _whole_batch_fails(model)

    def fit(max_steps, ckpt_path=None):
        strategy = LazyTrainStrategy(schedule=schedule, oom_fallback_steps=1)
        module = LMModule(copy.deepcopy(model))
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, train_dataloaders=loader(data), ckpt_path=ckpt_path)
        return module, trainer, strategy

    _, trainer, first = fit(2)
    assert first.run_plan.ladder.taken[-1] == "smaller layer micro-batches"
    assert first.run_plan.settings.layer_micro_batches == 2
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    resumed, trainer, strategy = fit(4, str(tmp_path / "step2.ckpt"))
    assert trainer.global_step == 4 and strategy.run_plan.settings.layer_micro_batches == 2
    assert strategy.run_plan.ladder.taken == first.run_plan.ladder.taken
    assert rel_diff(resumed.model, ref.model) <= 1e-6


def test_a_changed_schedule_is_not_overridden_by_the_saved_ladder(tmp_path, caplog):
    from lightning_lazytrain.engine import Schedule
    from lightning_lazytrain.planning import LinkDrift, OomLadder, RunPlan
    from lightning_lazytrain.schedule.plan_inputs import PlanSettings

    def run_plan(schedule: str) -> RunPlan:
        plan = RunPlan(PlanSettings(schedule), OomLadder(), LinkDrift(), None)
        plan.start("cpu", 2)
        return plan

    saving = run_plan("interval:1")
    saving.ladder = OomLadder(rung=4, taken=[RUNGS[3]], plan=Schedule.every(2, 1, 0))
    saving.ladder.plan.micro_batches = 2
    saving.settings = PlanSettings("interval:1", layer_micro_batches=2)
    loading = run_plan("interval:2")
    executor = SimpleNamespace(plan=loading.schedule)
    loading.load_state_dict(saving.state_dict())
    with caplog.at_level(logging.WARNING, logger="lightning_lazytrain.planning"):
        loading.before_batch(None, executor, 0, str(tmp_path))
    assert loading.settings.layer_micro_batches == "auto" and loading.ladder.taken == []
    assert executor.plan.micro_batches == 1 and loading.schedule.homes == Schedule.every(2, 2, 0).homes
    assert "this run has schedule='interval:2'" in caplog.text


def test_the_retry_loop_takes_a_rung_only_in_a_process_that_replans_alone():
    """``step_with_fallback`` on a stand-in plan: with several processes (``alone=False``) the first OOM is the
    GpuMemoryError naming the plan's batch shape, no rung taken; alone, the step runs again after one rung."""
    from lightning_lazytrain.engine import Schedule
    from lightning_lazytrain.planning import OomLadder, step_with_fallback

    rungs, calls = [], []
    plan = SimpleNamespace(ladder=OomLadder(), schedule=Schedule.every(2, 1, 0), shape=(2, 8),
                           take_rung=lambda executor, failure: rungs.append(str(failure)) or True)
    executor = SimpleNamespace(device=torch.device("cpu"), discard_step=lambda: calls.append("discard"))

    def run_step():
        calls.append("step")
        if calls.count("step") == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return "stepped"

    with pytest.raises(GpuMemoryError, match="plan for batch 2 x 8"):
        step_with_fallback(run_step, plan, executor, 0, 1, alone=False)
    assert rungs == [] and calls == ["step"]
    calls.clear()
    assert step_with_fallback(run_step, plan, executor, 0, 1, alone=True) == "stepped"
    assert rungs == ["CUDA out of memory. Tried to allocate 2.00 GiB"] and calls == ["step", "discard", "step"]
