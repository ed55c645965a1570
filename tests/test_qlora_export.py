"""A QLoRA run's export: the adapters load with peft over the same 4-bit base, and the merged model (the dequantized
base plus the adapters' deltas, full precision) loads with transformers alone; both answer greedily with the same
tokens as the trained module."""

import copy

import lightning.pytorch as pl
import torch
from helpers import batches, loader
from lora_models import AdapterModule
from peft import PeftModel
from qlora_models import tiny_4bit, tiny_qlora
from test_lora_export import _greedy
from transformers import AutoModelForCausalLM

from lightning_lazytrain.sft.export import HFExportCallback


def test_qlora_adapter_and_merged_exports_generate_what_the_trained_module_does(tmp_path):
    model = tiny_qlora("nf4", seed=2)
    export = HFExportCallback(str(tmp_path / "adapter"), dtype="float32", merged_dirpath=str(tmp_path / "merged"))
    module = AdapterModule(copy.deepcopy(model), lr=1e-2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[export])
    trainer.fit(module, loader(batches(3)))
    prompt = torch.tensor([[5, 17, 99, 3, 250, 41]])
    trained = _greedy(module.model.eval(), prompt)
    assert not torch.equal(trained, _greedy(model.eval(), prompt)), "training changed the answer"
    adapter = PeftModel.from_pretrained(tiny_4bit("nf4", seed=2), tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any(type(m).__name__ == "Linear4bit" for m in merged.modules()), "the merged model is full precision"
    assert torch.equal(_greedy(adapter, prompt), trained)
    assert torch.equal(_greedy(merged, prompt), trained)
