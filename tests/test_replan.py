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
    strategy.link_drift.probe = probe
    return strategy


def test_slow_link_replans_at_a_step_boundary(tmp_path, caplog):
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    strategy = _strategy(None)
    first = {}

    def probe_after_first_plan():
        first.setdefault("tiers", list(strategy.schedule_result.tiers))
        return 1e6, 1e6, 2e6  # 1 MB/s: another process owns the link

    strategy.link_drift.probe = probe_after_first_plan
    with caplog.at_level(logging.WARNING):
        lt, _ = train(model, data, strategy=strategy, default_root_dir=str(tmp_path))
    assert [e["step"] for e in strategy.link_drift.events] == [1]  # step 2 probes the same slow link: no drift
    assert any("re-planned at step 1" in r.getMessage() for r in caplog.records)
    assert "cpu" in first["tiers"] and "cpu" not in strategy.schedule_result.tiers
    assert strategy.schedule_result.profile.h2d_bytes_per_s == 1e6
    assert json.loads((tmp_path / "lazytrain_plan.json").read_text())["tiers"] == strategy.schedule_result.tiers
    assert rel_diff(lt.model, ref.model) <= 1e-6


def test_link_as_profiled_keeps_the_plan(tmp_path):
    strategy = _strategy(lambda: (H200_H2D * 1.1, H200_D2H * 0.9, H200_DUPLEX))  # within the 25% tolerance
    train(tiny_model("qwen3"), batches(3), strategy=strategy, default_root_dir=str(tmp_path))
    assert strategy.link_drift.events == []
