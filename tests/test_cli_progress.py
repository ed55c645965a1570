"""The train bar's title names the last epoch the run reaches (Lightning's own bar said ``Epoch 2/-2`` under
``max_steps``), or no total when there is no bound to take one from."""

import io
import math

import lightning.pytorch as pl
import pytest
import torch

from lightning_lazytrain.sft.progress import MaxStepsProgressBar, last_epoch_index


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
