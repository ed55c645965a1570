"""Liger's fused RMSNorm and SwiGLU in the streamed layers train to the weights plain HF training reaches."""

import pytest
from helpers import LMModule, batches, rel_diff, tiny_model, train, update_rel_diff

from lightning_lazytrain import LazyTrainStrategy

pytestmark = pytest.mark.gpu


class FusedCount(LMModule):
    """Records how many modules the executor bound Liger's kernels to, and checks they are unbound afterwards."""

    def on_train_start(self) -> None:
        self.fused = self.trainer.strategy.executor.fused_modules


def _unbound(module: LMModule) -> bool:
    return not any("forward" in m.__dict__ for layer in module.model.model.layers for m in layer.modules())


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_gpu_fp32_fused_matches_plain(family):
    model, data = tiny_model(family), batches(3, padded=True)
    ref, _ = train(model, data, accelerator="gpu")
    lt, _ = train(model, data, accelerator="gpu", module_cls=FusedCount,
                  strategy=LazyTrainStrategy(schedule="interval:2", keep_graph_layers=1, fused_kernels="liger"))
    assert lt.fused >= 3 * len(lt.model.model.layers)
    assert _unbound(lt)
    assert rel_diff(lt.model.cpu(), ref.model.cpu()) <= 1e-5


def test_gpu_bf16_fused_within_the_bf16_noise_of_plain():
    model, data = tiny_model("qwen2"), batches(3)
    ref32, _ = train(model, data, accelerator="gpu")
    ref16, _ = train(model, data, accelerator="gpu", precision="bf16-mixed")
    lt16, _ = train(model, data, accelerator="gpu", precision="bf16-mixed", module_cls=FusedCount,
                    strategy=LazyTrainStrategy(fused_kernels="liger"))
    assert lt16.fused > 0
    noise = update_rel_diff(model, ref16.model.cpu(), ref32.model.cpu())
    assert 0 < noise < 0.5, "the bf16 noise floor itself must be small for 2x of it to mean anything"
    assert update_rel_diff(model, lt16.model.cpu(), ref16.model.cpu()) <= 2 * noise
