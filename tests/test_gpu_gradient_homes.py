"""Gradient homes on a CUDA device: the D2H stream, pinned staging buffers and the I/O thread in play. Every home
gives the host home's weights (the CPU update reads the same gradients, staged or not), and the device home
holds its gradients on the GPU until the update: the plan's budget is that much smaller."""

import copy

import lightning.pytorch as pl
import pytest
from helpers import batches, loader, rel_diff, tiny_model
from test_engine_gradient_homes import HybridModule

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy

pytestmark = pytest.mark.gpu


class Reserve(pl.Callback):
    """The path's device reserve, read while the run holds it."""

    reserve = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        self.reserve = trainer.strategy.executor.device_update_reserve_bytes


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_gpu_every_home_gives_the_host_homes_weights(tmp_path, precision):
    model, data = tiny_model("qwen2"), batches(3)
    out = {}
    for home in ("host", "device", "nvme"):
        module, reserve = HybridModule(copy.deepcopy(model)), Reserve()
        strategy = LazyTrainStrategy(gradient_home=home, device_update_share=0.0, spill_dir=str(tmp_path))
        trainer = pl.Trainer(
            accelerator="gpu",
            devices=1,
            strategy=strategy,
            precision=precision,
            max_steps=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            gradient_clip_val=0.05,
            callbacks=[reserve],
        )
        trainer.fit(module, loader(data))
        out[home] = (module.model.cpu(), reserve.reserve, trainer.strategy.last_step_stats["d2h_gib"])
    itemsize = 4 if precision == "32-true" else 2
    grads = itemsize * sum(p.numel() for p in model.parameters())
    assert out["host"][1] == 0 and out["nvme"][1] == 0 and out["device"][1] == grads
    assert all(d2h > 0 for _, _, d2h in out.values())
    assert rel_diff(out["host"][0], model) > 1e-3
    for home in ("device", "nvme"):
        assert rel_diff(out[home][0], out["host"][0]) <= 1e-5, home  # the embedding backward may be atomic
