"""Plans with CPU, NVMe and recompute homes train exactly like the all-GPU plan; MILP and JSON plans run."""

import json
import os

import pytest
from helpers import batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.schedule import Schedule


def _plan_file(tmp_path, homes):
    path = tmp_path / "plan.json"
    path.write_text(Schedule(homes=homes, objective=0.0, predicted_exposed_seconds=0.0, status="given").to_json())
    return str(path)


@pytest.mark.parametrize(
    "homes",
    [["gpu", "cpu", "nvme", "recompute", "gpu"], ["gpu", "nvme", "nvme", "cpu", "gpu"],
     ["gpu", "recompute", "cpu", "recompute", "gpu"]],
    ids=["mixed", "spill-heavy", "recompute-blocks"],
)
def test_cpu_nvme_recompute_homes_match_all_gpu(tmp_path, homes):
    model, data = tiny_model("qwen2"), batches(3, padded=True)
    spill = tmp_path / "spill"
    spill.mkdir()
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    plan = _plan_file(tmp_path, homes)
    lt, trainer = train(model, data, strategy=LazyTrainStrategy(schedule=plan, spill_dir=str(spill)))
    assert rel_diff(lt.model, ref.model) <= 1e-6
    stats = trainer.strategy.last_step_stats
    # one step's bytes (3 steps ran): each CPU/NVMe boundary of 2 x 16 tokens x 64 fp32 goes out and back once
    moved, nvme, boundary = sum(t in ("cpu", "nvme") for t in homes), homes.count("nvme"), 2 * 16 * 64 * 4
    assert stats["act_offload_bytes"] == stats["act_reload_bytes"] == moved * boundary
    assert stats["act_nvme_write_bytes"] == stats["act_nvme_read_bytes"] == nvme * boundary
    assert os.listdir(spill) == [], "spill files and the run's folder are gone after teardown"


def test_nvme_plan_without_spill_dir_is_refused(tmp_path):
    plan = _plan_file(tmp_path, ["gpu", "nvme", "gpu", "gpu", "gpu"])
    with pytest.raises(ValueError, match="spill_dir"):
        train(tiny_model("qwen2"), batches(1), strategy=LazyTrainStrategy(schedule=plan), max_steps=1)


def test_plan_for_another_depth_is_refused(tmp_path):
    plan = _plan_file(tmp_path, ["gpu", "gpu", "gpu"])
    with pytest.raises(ValueError, match="2 layers"):
        train(tiny_model("qwen2"), batches(1), strategy=LazyTrainStrategy(schedule=plan), max_steps=1)


def test_milp_plan_solved_at_first_batch_written_and_trains_like_all_gpu(tmp_path):
    model, data = tiny_model("qwen3"), batches(3)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    # budgets that cannot hold every boundary on the GPU force a mixed plan
    act = 2 * 16 * 64 * 4
    strategy = LazyTrainStrategy(schedule="milp", gpu_activation_gib=2.5 * act / 2**30,
                                 cpu_activation_gib=1.0 * act / 2**30, solver_time_limit=5.0)
    lt, trainer = train(model, data, strategy=strategy, default_root_dir=str(tmp_path))
    plan = json.loads((tmp_path / "lazytrain_plan.json").read_text())
    homes = plan["homes"]
    assert len(homes) == 5 and homes[0] == homes[-1] == "gpu"
    assert set(homes[1:-1]) != {"gpu"}, homes
    stats, info = trainer.strategy.last_step_stats, plan["info"]
    # the predicted link wait: the transfers the plan could not hide and the first layer's weight copy
    assert stats["predicted_stall_s"] == pytest.approx(info["slack_seconds"] + info["step_start_seconds"])
    assert info["step_start_seconds"] > 0 and "predicted_exposed_s" in stats
    assert rel_diff(lt.model, ref.model) <= 1e-6


def test_the_default_schedule_is_the_milp_on_cuda_and_a_fixed_plan_elsewhere(tmp_path):
    """``schedule="auto"``: the MILP where the GPU's memory bounds the plan, ``interval:1`` on the CPU accelerator,
    so a CPU run plans alike on every machine and trains as the interval plan does."""
    from lightning_lazytrain.schedule.plan_inputs import PlanSettings

    assert LazyTrainStrategy().schedule == "auto"
    assert PlanSettings().on_device("cuda").schedule == "milp"
    assert PlanSettings().on_device("cpu").schedule == "interval:1"
    assert PlanSettings("interval:4").on_device("cuda").schedule == "interval:4"
    model, data = tiny_model("qwen2"), batches(2)
    ref, _ = train(model, data, strategy=LazyTrainStrategy(schedule="interval:1"))
    strategy = LazyTrainStrategy()
    lt, _ = train(model, data, strategy=strategy, default_root_dir=str(tmp_path))
    assert strategy.schedule == "interval:1" and strategy.schedule_result is None
    assert not (tmp_path / "lazytrain_plan.json").exists()
    assert rel_diff(lt.model, ref.model) == 0.0
