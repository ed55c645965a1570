"""A pretrained model trains in training mode: ``from_pretrained`` returns it in eval mode and Lightning keeps the
mode it finds, so dropout was silently off (Lightning warned "Found N module(s) in eval mode")."""

import warnings

import pytest
import torch
from helpers import batches, loader, tiny_model

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer
from lightning_lazytrain.sft.module import CausalLMModule


class ModeRecordingModule(CausalLMModule):
    """Records, in each training step, the modules not in training mode and the loss."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eval_modules: list[list[str]] = []
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        self.eval_modules.append([name for name, m in self.named_modules() if not m.training])
        loss = super().training_step(batch, batch_idx)
        self.losses.append(float(loss.detach()))
        return loss


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("pretrained")
    vocab = len(load_tokenizer())  # the module refuses a tokenizer longer than the embedding
    tiny_model("qwen2-tied", attention_dropout=0.3, vocab_size=vocab).save_pretrained(path)
    return str(path)


def _fit(pretrained_dir: str, strategy: str, seed: int) -> tuple[ModeRecordingModule, list[str]]:
    import lightning.pytorch as pl

    module = ModeRecordingModule(pretrained=pretrained_dir, max_generate_samples=0, lr=1e-3)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, train_dataloaders=loader(batches(3, padded=True, seed=3)))
    return module, [str(w.message) for w in caught]


def test_pretrained_model_trains_with_dropout_under_lazytrain_as_under_plain_lightning(pretrained_dir):
    lazy, lazy_warnings = _fit(pretrained_dir, "lazytrain", seed=7)
    plain, _ = _fit(pretrained_dir, "auto", seed=7)
    other_seed, _ = _fit(pretrained_dir, "lazytrain", seed=8)
    assert lazy.eval_modules == [[], [], []], "every module in training mode in every step"
    assert not [w for w in lazy_warnings if "eval mode" in w], lazy_warnings
    assert lazy.losses == pytest.approx(plain.losses, rel=1e-6)
    assert abs(other_seed.losses[0] - lazy.losses[0]) > 1e-4, "dropout masks must change the loss"
