"""Mid-epoch resume of the SFT recipe (CausalLMModule + SFTDataModule on the demo set, HybridAdamW 8-bit states,
warm-up + cosine schedule): the resumed run sees the same batches and ends with the same weights and states."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from resume_setup import Crash, CrashAt, assert_same_tree

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.sft.data.sft import SFTDataModule
from lightning_lazytrain.sft.module import CausalLMModule

TINY = dict(model_type="qwen2", vocab_size=151669, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True)
STEPS = 6  # 8 batches per epoch: the crash after step 3 is mid-epoch


class Recorder(pl.Callback):
    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch["input_ids"].clone())


def fit(module, data, dirpath, ckpt_path=None, crash_at=None):
    recorder = Recorder()
    callbacks = [recorder, pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_last=True,
                                                        save_top_k=0)]
    if crash_at is not None:
        callbacks.append(CrashAt(crash_at))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true", max_steps=STEPS,
                         limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks)
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer, recorder.batches


@pytest.fixture(scope="module")
def data():
    # one datamodule for the three runs: the tokenizer is built once (it takes seconds); each run still gets a
    # fresh train dataloader and sampler
    return SFTDataModule("demo", max_seq_length=48, batch_size=4, max_samples=36, val_fraction=0.1, seed=7)


@pytest.fixture(scope="module")
def start():
    torch.manual_seed(0)
    module = CausalLMModule(model_config=TINY, optimizer="lightning_lazytrain.optim.HybridAdamW", lr=1e-3,
                            optimizer_kwargs={"eight_bit_fraction": 1.0}, warmup_steps=2)
    module.configure_model()  # built now, under the seed: the three runs' copies start from the same weights
    return module


def test_sft_resume_mid_epoch_matches_unbroken(tmp_path, data, start):
    ref_trainer, ref_batches = fit(copy.deepcopy(start), data, tmp_path / "ref")
    k = 3
    with pytest.raises(Crash):
        fit(copy.deepcopy(start), data, tmp_path / "run", crash_at=k)
    resumed = copy.deepcopy(start)
    trainer, batches = fit(resumed, data, tmp_path / "run", ckpt_path="last")
    assert ref_trainer.num_training_batches == 8 and len(ref_batches) == STEPS
    assert len(batches) == STEPS - k
    for got, want in zip(batches, ref_batches[k:], strict=True):
        assert torch.equal(got, want)
    opt = trainer.optimizers[0]
    assert any(opt.is_8bit(p) for p in resumed.parameters())
    assert_same_tree(resumed.state_dict(), ref_trainer.lightning_module.state_dict(), "weights")
    assert_same_tree(opt.state_dict(), ref_trainer.optimizers[0].state_dict(), "optimizer")
    assert opt.param_groups[0]["lr"] == ref_trainer.optimizers[0].param_groups[0]["lr"]
    assert not torch.equal(resumed.model.model.embed_tokens.weight, start.model.model.embed_tokens.weight)
