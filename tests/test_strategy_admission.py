"""Admission control before step 1: a run that cannot fit host RAM is refused with the table and a remedy."""

import collections

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, tiny_model, train

import lightning_lazytrain.admission.measure as admission
from lightning_lazytrain.tier_report import AdmissionError

Mem = collections.namedtuple("Mem", "available")


def test_lazy_adam_states_that_do_not_fit_are_refused_before_step_one(monkeypatch):
    model = tiny_model("qwen2")
    n = sum(p.numel() for p in model.parameters())
    # room for everything but half of AdamW's lazily allocated 8 B/param states
    monkeypatch.setattr(admission.psutil, "virtual_memory", lambda: Mem(available=4 * n + 4 * n))
    module, start = LMModule(model), {k: v.clone() for k, v in model.state_dict().items()}
    trainer = pl.Trainer(accelerator="cpu", strategy="lazytrain", max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(AdmissionError, match=r"host RAM short by[\s\S]*optimizer states[\s\S]*8-bit optimizer states"):
        trainer.fit(module, loader(batches(1)))
    assert module.losses == [], "no training step may run"
    assert all(torch.equal(v, start[k]) for k, v in module.model.state_dict().items())


def test_report_counts_what_the_run_needs(monkeypatch):
    seen = {}
    real = admission.admission_report

    def spy(**kw):
        seen.update(kw)
        return real(**kw)

    monkeypatch.setattr(admission, "admission_report", spy)
    model = tiny_model("qwen2")
    train(model, batches(1), strategy="lazytrain", max_steps=1)
    assert seen["num_params"] == sum(p.numel() for p in model.parameters())
    assert seen["optimizer_state_bytes_per_param"] == 8.0
    assert seen["precision"] == "32-true" and seen["grad_accumulation"] is True
