"""The fused kernel's code path that runs is logged at fit start."""

import logging

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, tiny_model

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.optim.kernel import PATH_ENV, find_compiler, runnable_paths


class HybridModule(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=self.lr, eight_bit_fraction=1.0, min_8bit_numel=1024)


class PlainModule(LMModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler for the fused kernel")
@pytest.mark.parametrize(("module_cls", "path"), [(HybridModule, runnable_paths()[-1]), (PlainModule, None)])
def test_fit_start_logs_the_update_path(monkeypatch, caplog, module_cls, path):
    if path:
        monkeypatch.setenv(PATH_ENV, path)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=LazyTrainStrategy(),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with caplog.at_level(logging.INFO, logger="lightning_lazytrain.run_engine"):
        trainer.fit(module_cls(tiny_model("qwen3")), loader(batches(1)))
    lines = [r.getMessage() for r in caplog.records if "CPU update path" in r.getMessage()]
    assert lines == [f"lazytrain CPU update path: {path or 'AdamW'}"]
