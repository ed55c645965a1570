"""The train bar's title names the last epoch the run reaches (Lightning's own bar said ``Epoch 2/-2`` under
``max_steps``), or no total when there is no bound to take one from."""

import io
import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_lazytrain.sft.progress import MaxStepsProgressBar, epoch_batch_total, last_epoch_index


class Linear(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("max_epochs", "max_steps", "batches", "accumulate", "last"), [
    (-1, 300, 132, 1, 2),          # the demo: 300 steps of 132-batch epochs touch epochs 0, 1, 2
    (-1, 264, 132, 1, 1),          # exactly two epochs
    (-1, 300, 132, 2, 4),          # 600 batches
    (1, 300, 132, 1, 0),           # the epoch bound comes first
    (5, -1, 132, 1, 4),            # no step bound: Lightning's own total
    (-1, 4, math.inf, 1, None),    # an endless loader: no total
    (None, -1, 132, 1, None),      # no bound at all
    (-1, 0, 132, 1, 0),
])
def test_last_epoch_index(max_epochs, max_steps, batches, accumulate, last):
    assert last_epoch_index(max_epochs, max_steps, batches, accumulate) == last


@pytest.mark.parametrize(("max_steps", "max_epochs", "titles"), [(5, None, ["Epoch 2/2"]), (None, 2, ["Epoch 1/1"])])
def test_rendered_bar_shows_the_last_epoch(max_steps, max_epochs, titles):
    screen = io.StringIO()
    bar = MaxStepsProgressBar(console_kwargs={"file": screen, "force_terminal": False, "width": 160})
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(4, 2)), batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", max_steps=max_steps or -1, max_epochs=max_epochs, callbacks=[bar],
                         logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Linear(), data)
    assert [task.description.strip() for task in bar.progress.tasks] == titles
    assert titles[-1] in screen.getvalue() and "/-" not in screen.getvalue()


@pytest.mark.parametrize(("done", "batches", "max_steps", "step", "accumulate", "total"), [
    (0, 132, 300, 0, 1, 132),      # the demo's first epoch: every batch
    (0, 132, 300, 264, 1, 36),     # its third: the 36 steps left
    (4, 8, 5, 4, 1, 5),            # resumed at step 4 of 5 in an 8-batch epoch: it ends after batch 5
    (1, 8, 5, 0, 2, 8),            # 10 batches left from 1 (one waiting to step): the epoch's 8
    (1, 20, 5, 0, 2, 10),          # ... in a 20-batch epoch: 10
    (0, 8, -1, 3, 1, 8),           # no step bound
    (0, math.inf, 5, 0, 1, 5),     # an endless loader
])
def test_epoch_batch_total(done, batches, max_steps, step, accumulate, total):
    assert epoch_batch_total(done, batches, max_steps, step, accumulate) == total


@pytest.mark.parametrize(("max_steps", "accumulate", "bars"), [
    (5, 1, [("Epoch 0/0", 5, 5)]), (12, 1, [("Epoch 1/1", 4, 4)]), (5, 2, [("Epoch 1/1", 2, 2)])])
def test_resumed_bar_counts_to_its_total(tmp_path, max_steps, accumulate, bars):
    """Resumed from the step-3 save of an 8-batch epoch; Lightning's bar read 5/1 for max_steps=5."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 2)), batch_size=2)

    def fit(steps, callbacks, ckpt=None, accumulate=1):
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, callbacks=callbacks, logger=False,
                             enable_model_summary=False, accumulate_grad_batches=accumulate,
                             default_root_dir=tmp_path)
        trainer.fit(Linear(), data, ckpt_path=ckpt)

    fit(3, [MaxStepsProgressBar(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, filename="step3")],
        accumulate=accumulate)
    screen = io.StringIO()
    bar = MaxStepsProgressBar(console_kwargs={"file": screen, "force_terminal": False, "width": 160})
    fit(max_steps, [bar], ckpt=str(tmp_path / "step3.ckpt"), accumulate=accumulate)
    assert [(t.description.strip(), t.completed, t.total) for t in bar.progress.tasks] == bars
    last = bars[-1]
    assert f"{last[1]}/{last[2]}" in screen.getvalue()
