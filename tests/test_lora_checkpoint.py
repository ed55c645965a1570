"""A LoRA run's checkpoints hold the adapters, their optimizer state and a fingerprint of the frozen base: their
size follows the trainable weights, a resume from one is exact, and a resume over another base is refused."""

import copy
import os

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader
from lora_models import tiny_lora, trainable_and_frozen
from resume_setup import MAX_STEPS, CrashAt, NoisyHybridModule, assert_same_tree, data_loader, saver

from lightning_lazytrain.checkpoint.trainable import BASE_KEY, BaseMismatchError
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.sft.checkpointing import ResumableModelCheckpoint


class NoisyAdapterModule(NoisyHybridModule):
    """The resume tests' run (global-RNG loss weight, 8-bit and fp32 moments, per-step LR), adapters only."""

    def configure_optimizers(self):
        trainable = [p for p in self.parameters() if p.requires_grad]
        opt = HybridAdamW(trainable, lr=self.lr, weight_decay=0.01, eight_bit_fraction=0.5, min_8bit_numel=128)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(model, dirpath, ckpt_path=None, crash_at=None, seed=123):
    module = NoisyAdapterModule(copy.deepcopy(model))
    callbacks = [saver(dirpath)] if dirpath else []
    callbacks += [CrashAt(crash_at)] if crash_at else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="bf16-mixed",
                         max_steps=MAX_STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(dirpath), callbacks=callbacks, num_sanity_val_steps=0)
    torch.manual_seed(seed)
    trainer.fit(module, data_loader(), ckpt_path=ckpt_path)
    return module, trainer


def test_resume_from_a_trainable_only_checkpoint_equals_the_unbroken_run(tmp_path):
    model = tiny_lora(seed=3)
    ref, ref_trainer = _fit(model, None)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, str(tmp_path), crash_at=4)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(saved["state_dict"]) == trainable, "the checkpoint holds the adapters and nothing of the base"
    assert saved[BASE_KEY]["frozen_tensors"] == sum(1 for p in ref.parameters() if not p.requires_grad)
    resumed, trainer = _fit(model, str(tmp_path), ckpt_path="last", seed=999)
    assert trainer.global_step == ref_trainer.global_step == MAX_STEPS
    assert_same_tree(resumed.state_dict(), ref.state_dict(), "weights")
    assert_same_tree(trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict(), "optimizer")
    assert resumed.losses == ref.losses[4:] and resumed.draws == ref.draws[4:]
    assert sum(float((p - q).abs().sum()) for p, q in zip(ref.parameters(), model.parameters())
               if p.requires_grad) > 0, "the adapters trained"


@pytest.mark.parametrize(("other", "match"), [
    (lambda: tiny_lora(seed=4), "a different sample of values"),
    (lambda: tiny_lora(seed=3, targets=("q_proj", "k_proj")), "other names or shapes"),
], ids=["other-base-values", "other-target-modules"])
def test_resume_over_another_base_is_refused_naming_the_fix(tmp_path, other, match):
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(tiny_lora(seed=3), str(tmp_path), crash_at=2)
    with pytest.raises(BaseMismatchError, match=f"{match}.*resume with the base model the run started from"):
        _fit(other(), str(tmp_path), ckpt_path="last")


class _SizeAtFitStart(ResumableModelCheckpoint):
    def check_disk(self, trainer, pl_module):
        self.estimate = self.checkpoint_size(trainer, pl_module)
        super().check_disk(trainer, pl_module)


class _TorchAdapterModule(LMModule):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def _checkpoint_of(model, dirpath) -> tuple[int, int]:
    saver = _SizeAtFitStart(dirpath=dirpath, every_n_train_steps=1, save_last=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true", max_steps=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[saver],
                         num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(_TorchAdapterModule(copy.deepcopy(model)), loader(batches(1)))
    return os.path.getsize(saver.best_model_path), saver.estimate


def test_checkpoint_size_follows_the_trainable_weights(tmp_path):
    """fp32 masters and AdamW's two fp32 moments: 12 bytes per trainable parameter, none per frozen one."""
    small, large = tiny_lora(r=2), tiny_lora(r=16)
    (t_small, frozen), (t_large, _) = trainable_and_frozen(small), trainable_and_frozen(large)
    size_small, estimate_small = _checkpoint_of(small, tmp_path / "r2")
    size_large, _ = _checkpoint_of(large, tmp_path / "r16")
    assert size_small < 4 * frozen / 10, "far below the base's fp32 bytes"
    assert size_large - size_small == pytest.approx(12 * (t_large - t_small), rel=0.1)
    assert size_small - 12 * t_small < 64 * 1024, "beyond the tensors, only a small fixed overhead"
    assert estimate_small == pytest.approx(12 * t_small), "the disk check sizes the adapters, not the base"
