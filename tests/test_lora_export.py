"""A LoRA run's export: the adapters in peft's format and the merged model load back and answer greedily with the
same tokens as the trained module; a model that cannot be exported is refused before training."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, loader
from lora_models import AdapterModule, tiny_lora
from peft import PeftModel
from transformers import AutoModelForCausalLM

from lightning_lazytrain.sft.export import HFExportCallback


def _greedy(model, prompt):
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, prompt.shape[1]:]


def test_adapter_and_merged_exports_generate_what_the_trained_module_does(tmp_path):
    model = tiny_lora(seed=2)
    base = copy.deepcopy(model.get_base_model())  # its weights before the adapters train (the base is frozen)
    export = HFExportCallback(str(tmp_path / "adapter"), dtype="float32", merged_dirpath=str(tmp_path / "merged"))
    module = AdapterModule(copy.deepcopy(model), lr=1e-2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[export])
    trainer.fit(module, loader(batches(3)))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    prompt = torch.tensor([[5, 17, 99, 3, 250, 41]])
    trained = _greedy(module.model.eval(), prompt)
    assert not torch.equal(trained, _greedy(model.eval(), prompt)), "training changed the answer"
    for_base = tiny_lora(seed=2).get_base_model()  # a fresh copy of the same base, unwrapped
    for_base.load_state_dict(base.state_dict())
    adapter = PeftModel.from_pretrained(for_base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert torch.equal(_greedy(adapter, prompt), trained)
    assert torch.equal(_greedy(merged, prompt), trained)


def test_a_module_without_a_hf_or_peft_model_is_refused_at_fit_start():
    class NoModel(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            raise AssertionError("no step may run")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[HFExportCallback("unused")])
    with pytest.raises(TypeError, match="Linear: exporting needs a transformers PreTrainedModel or a peft model"):
        trainer.fit(NoModel(), loader([torch.zeros(2)]))
