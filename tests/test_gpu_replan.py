"""Mid-run MILP plans on a CUDA device: a larger batch is planned for with the device memory the first plan had,
not less by what the caching allocator kept from earlier steps; training matches plain in fp32."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy

pytestmark = pytest.mark.gpu
CACHED = 4 << 30


class LeaveCachedBlocks(pl.Callback):
    """After step 1, a 4 GiB tensor is freed: the caching allocator keeps its block reserved."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            block = torch.empty(CACHED, dtype=torch.uint8, device="cuda")
            del block


def test_gpu_a_longer_batch_is_planned_with_the_first_plans_device_memory(monkeypatch):
    from lightning_lazytrain.planning import solve

    totals, device_plan_bytes = [], solve.device_plan_bytes
    monkeypatch.setattr(solve, "device_plan_bytes", lambda e: totals.append(device_plan_bytes(e)) or totals[-1])
    data = batches(1, seq=16) + batches(1, seq=200, seed=2) + batches(1, seq=16, seed=3)
    plain, _ = train(tiny_model("qwen3"), data, accelerator="gpu")
    strategy = LazyTrainStrategy(schedule="milp")
    lt, _ = train(tiny_model("qwen3"), data, accelerator="gpu", strategy=strategy, callbacks=[LeaveCachedBlocks()])
    assert strategy.run_plan.shape == (2, 256)
    first, replanned = totals[0], totals[-1]
    print(f"plan totals: first {first / 2**30:.2f} GiB, after step 1 {replanned / 2**30:.2f} GiB")
    assert abs(first - replanned) < CACHED / 4
    assert rel_diff(lt.model.cpu(), plain.model.cpu()) <= 1e-5


def test_gpu_the_default_strategy_solves_the_milp(tmp_path):
    """``strategy="lazytrain"`` with no option on CUDA: the plan is the MILP's, solved at the first batch and
    written beside the logs, and the run matches plain."""
    data = batches(2)
    plain, _ = train(tiny_model("qwen3"), data, accelerator="gpu")
    strategy = LazyTrainStrategy()
    lt, _ = train(tiny_model("qwen3"), data, accelerator="gpu", strategy=strategy, default_root_dir=str(tmp_path))
    assert strategy.schedule == "milp" and strategy.run_plan.shape == (2, 16)
    assert strategy.schedule_result is not None and (tmp_path / "lazytrain_plan.json").exists()
    assert rel_diff(lt.model.cpu(), plain.model.cpu()) <= 1e-5
