"""A CUDA out-of-memory error inside a step reaches the user as a GpuMemoryError that names the plan, the bytes
asked and what to change (simulated on the CPU: the engine's control flow is the same)."""

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, tiny_model

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.faults import GpuMemoryError, ResourceError


class OutOfMemoryModule(LMModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 592.00 MiB. GPU 0 has ...")
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("schedule", ["interval:2", "milp"])
def test_out_of_memory_in_a_step_names_bytes_plan_and_fixes(schedule):
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=LazyTrainStrategy(schedule=schedule),
                         precision="32-true", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(GpuMemoryError) as info:
        trainer.fit(OutOfMemoryModule(tiny_model("qwen2")), torch.utils.data.DataLoader(batches(3), batch_size=None))
    err = info.value
    assert isinstance(err, ResourceError) and isinstance(err.__cause__, torch.OutOfMemoryError)
    assert err.asked == 592 * 2**20
    text = str(err)
    assert "GPU memory" in text and "592.0 MiB" in text
    assert "'gpu': " in text and "'recompute': " in text
    assert "smaller batch" in text and "expandable_segments" in text and "layer_micro_batches" in text
    assert "layers in 2 row slices" in text  # the ladder's last plan: batch 2, one row a slice
    assert ("(plan for batch 2 x 16: " if schedule == "milp" else "(plan: ") in text
