"""Online re-plan: a slow link injected through the probe re-solves the MILP at a step boundary, logged; the
profile's figures and a steady link leave the plan alone; training still matches the all-GPU plan."""

import json
import logging

from helpers import batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.schedule.profile import H200_D2H, H200_DUPLEX, H200_H2D

ACT = 2 * 16 * 64 * 4  # one boundary of the tiny model at batch 2 x 16, fp32


def _strategy(probe) -> LazyTrainStrategy:
    # budgets that push boundaries to the CPU while the link is fast
    strategy = LazyTrainStrategy(
        schedule="milp",
        gpu_activation_gib=2.5 * ACT / 2**30,
        cpu_activation_gib=1.0 * ACT / 2**30,
        solver_time_limit=5.0,
        replan_every_n_steps=1,
    )
    strategy.run_plan.link_drift.probe = probe
    return strategy


def test_slow_link_replans_at_a_step_boundary(tmp_path, caplog):
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    strategy = _strategy(None)
    first = {}

    def probe_after_first_plan():
        first.setdefault("homes", list(strategy.schedule_result.homes))
        return 1e6, 1e6, 2e6  # 1 MB/s: another process owns the link

    strategy.run_plan.link_drift.probe = probe_after_first_plan
    with caplog.at_level(logging.WARNING):
        lt, _ = train(model, data, strategy=strategy, default_root_dir=str(tmp_path))
    assert [e["step"] for e in strategy.run_plan.link_drift.events] == [1]  # step 2 probes the same slow link: no drift
    assert any("re-planned at step 1" in r.getMessage() for r in caplog.records)
    assert "cpu" in first["homes"] and "cpu" not in strategy.schedule_result.homes
    assert strategy.run_plan.profile.h2d_bytes_per_s == 1e6
    assert json.loads((tmp_path / "lazytrain_plan.json").read_text())["homes"] == strategy.schedule_result.homes
    assert rel_diff(lt.model, ref.model) <= 1e-6


def test_link_as_profiled_keeps_the_plan(tmp_path):
    strategy = _strategy(lambda: (H200_H2D * 1.1, H200_D2H * 0.9, H200_DUPLEX))  # within the 25% tolerance
    train(tiny_model("qwen3"), batches(3), strategy=strategy, default_root_dir=str(tmp_path))
    assert strategy.run_plan.link_drift.events == []


def test_a_larger_batch_is_planned_for_before_it_runs(tmp_path, caplog, monkeypatch):
    """Batches padded to their longest sample change shape. A batch longer or wider than the plan's shape is
    planned for first (its length rounded up to 128), which the budget then fits with other homes; a smaller batch
    keeps the larger plan. Training matches the plain run throughout."""
    import lightning_lazytrain.planning.run_plan as run_plan

    data = batches(1, seq=16) + batches(1, seq=24, seed=2) + batches(1, seq=16, seed=3) + batches(1, 3, 20, seed=4)
    plain, _ = train(tiny_model("qwen3"), data, max_steps=4)
    solved, measure_profile = [], run_plan.measure_profile
    monkeypatch.setattr(run_plan, "measure_profile", lambda s, e, shape: solved.append(shape) or measure_profile(
        s, e, shape))
    strategy = LazyTrainStrategy(schedule="milp", gpu_activation_gib=36 * ACT / 2**30, cpu_activation_gib=0.0)
    tiers = []
    strategy.run_plan.before_batch = _after(strategy.run_plan.before_batch,
                                            lambda: tiers.append(list(strategy.schedule_result.homes)))
    with caplog.at_level(logging.WARNING):
        lt, _ = train(tiny_model("qwen3"), data, strategy=strategy, max_steps=4, default_root_dir=str(tmp_path))
    assert solved == [(2, 16), (2, 128), (3, 128)]
    assert strategy.run_plan.shape == (3, 128)
    grown = [r.getMessage() for r in caplog.records if "larger than" in r.getMessage()]
    assert grown == ["lazytrain: batch 2 x 24 is larger than the 2 x 16 the plan was solved for: solving it for "
                     "2 x 128", "lazytrain: batch 3 x 20 is larger than the 2 x 128 the plan was solved for: "
                     "solving it for 3 x 128"]
    # room for 36 boundaries of 2 x 16 on the GPU: every one at 2 x 16; at 2 x 128 (8 times the bytes) the two ends
    # and two more; at 3 x 128 the ends and one
    assert [t[1:-1].count("gpu") for t in tiers] == [3, 2, 2, 1]  # batch 3 (2 x 16) runs the 2 x 128 plan
    assert rel_diff(lt.model, plain.model) <= 5e-6


def _after(method, then):
    def wrapped(*args, **kwargs):
        method(*args, **kwargs)
        then()

    return wrapped


def test_a_plan_solved_for_a_larger_batch_gets_the_oom_ladder_again():
    """The ladder acts in a plan's first steps: the run's, and those of a plan solved at step 4 for a longer batch.
    An OOM in that batch takes a rung instead of stopping the run."""
    import torch

    data = batches(4, seq=16) + batches(1, seq=24, seed=2)
    model, left = tiny_model("qwen3"), {"n": 1}

    def hook(module, args):
        if args[0].shape[1] > 16 and left["n"] > 0:
            left["n"] -= 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.model.layers[1].mlp.register_forward_pre_hook(hook)
    plain, _ = train(tiny_model("qwen3"), data, max_steps=5)
    strategy = LazyTrainStrategy(schedule="milp")
    lt, trainer = train(model, data, strategy=strategy, max_steps=5)
    assert left["n"] == 0 and strategy.run_plan.ladder.taken and strategy.run_plan.ladder.since == 4
    assert trainer.global_step == 5 and rel_diff(lt.model, plain.model) <= 5e-6
