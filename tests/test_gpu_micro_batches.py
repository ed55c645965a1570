"""Layer micro-batches on a CUDA device: the same weights as the whole-batch run, and a step peak lower by about
what the MILP's working-set count says."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, rel_diff, tiny_model, train

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.schedule.layer_memory import analytic_layer_estimates, micro_batch_working_bytes, unique_numel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen2", "qwen3-moe", "qwen3.5"])
def test_gpu_fp32_micro_batches_match_plain(family):
    model, data = tiny_model(family), batches(3, batch=4, padded=True)
    plain, _ = train(model, data, accelerator="gpu")
    strategy = LazyTrainStrategy(schedule="interval:2", keep_graph_layers=1, layer_micro_batches=3)
    lt, _ = train(model, data, accelerator="gpu", strategy=strategy)
    assert rel_diff(lt.model.cpu(), plain.model.cpu()) <= 1e-5


class PeakMemory(pl.Callback):
    """The step's peak above what was allocated when the batch started: in a run of the whole GPU suite, tensors of
    earlier tests that the garbage collector has not reached yet (Trainers hold reference cycles) are held too, and
    they made the whole-batch peak of this test 0.6 GiB larger on the device than when it runs alone."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._start = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._start = torch.cuda.memory_allocated()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        torch.cuda.synchronize()
        self.peaks.append(torch.cuda.max_memory_allocated() - self._start)


def test_gpu_micro_batches_lower_the_step_peak_by_the_planned_working_set():
    """A layer with a wide MLP (256 -> 4096) at 16 x 512 tokens in bf16: its working set is most of the step's
    peak, and four micro-batches take at least half of what `micro_batch_working_bytes` says off it."""
    model = tiny_model("qwen2", hidden_size=256, intermediate_size=4096)
    data = batches(2, batch=16, seq=512)
    peaks = {}
    for k in (1, 4):
        meter = PeakMemory()
        train(model, data, max_steps=2, accelerator="gpu", precision="bf16-mixed", callbacks=[meter],
              strategy=LazyTrainStrategy(schedule="interval:1", layer_micro_batches=k))
        peaks[k] = meter.peaks[-1]
    layer = model.model.layers[0]
    working = analytic_layer_estimates(adapter_for(model), 16 * 512, 2, 1e12).working_bytes[0]
    planned = working - micro_batch_working_bytes(working, unique_numel(layer) * 2, 16 * 512 * 256 * 2, 4)
    print(f"peak whole batch {peaks[1] / 2**20:.1f} MiB, four micro-batches {peaks[4] / 2**20:.1f} MiB, "
          f"planned drop {planned / 2**20:.1f} MiB")
    assert planned > 0.4 * peaks[1]
    assert peaks[1] - peaks[4] >= 0.5 * planned
