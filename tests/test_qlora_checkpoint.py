"""A QLoRA run's checkpoints hold the adapters and their optimizer state, nothing of the 4-bit base, and a resume
from one is exact."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from qlora_models import packed_base, tiny_qlora
from resume_setup import MAX_STEPS, CrashAt, assert_same_tree, data_loader, saver
from test_lora_checkpoint import NoisyAdapterModule

from lightning_lazytrain.checkpoint.trainable import BASE_KEY


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


def test_qlora_resume_from_a_trainable_only_checkpoint_equals_the_unbroken_run(tmp_path):
    model = tiny_qlora("nf4", seed=3)
    ref, ref_trainer = _fit(model, None)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _fit(model, str(tmp_path), crash_at=4)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 4
    trainable = {n for n, p in ref.named_parameters() if p.requires_grad}
    assert set(saved["state_dict"]) == trainable, "the checkpoint holds the adapters, no 4-bit codes or quant state"
    assert saved[BASE_KEY]["frozen_tensors"] == sum(1 for p in ref.parameters() if not p.requires_grad)
    resumed, trainer = _fit(model, str(tmp_path), ckpt_path="last", seed=999)
    assert trainer.global_step == ref_trainer.global_step == MAX_STEPS
    adapters = {k: v for k, v in resumed.state_dict().items() if k in trainable}
    assert_same_tree(adapters, {k: v for k, v in ref.state_dict().items() if k in trainable}, "adapters")
    assert_same_tree(trainer.optimizers[0].state_dict(), ref_trainer.optimizers[0].state_dict(), "optimizer")
    assert resumed.losses == ref.losses[4:] and resumed.draws == ref.draws[4:]
    before, after = packed_base(model), packed_base(resumed.model)
    assert all(torch.equal(after[k], before[k]) for k in before), "the 4-bit base is the one the run started from"
    assert sum(float((p - q).abs().sum()) for p, q in zip(ref.parameters(), model.parameters())
               if p.requires_grad) > 0, "the adapters trained"
