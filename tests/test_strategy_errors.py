"""Errors a user can hit before step 1, each naming the thing and what to change."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from helpers import LMModule, batches, loader, tiny_model
from transformers import AutoModelForCausalLM, GPT2Config

import lightning_lazytrain
from lightning_lazytrain import LazyTrainStrategy, ModelNotFoundError, UnsupportedModelError
from lightning_lazytrain.sft.demo import main as demo_main


def fit(module, strategy="lazytrain", **kw):
    trainer = pl.Trainer(accelerator="cpu", strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **kw)
    trainer.fit(module, loader(batches(1)))
    return trainer


class NoModel(LMModule):
    def __init__(self):
        pl.LightningModule.__init__(self)
        self.model = torch.nn.Linear(4, 4)


class TwoModels(LMModule):
    def __init__(self):
        super().__init__(tiny_model("qwen2"))
        self.teacher = tiny_model("qwen3")


def test_no_pretrained_model():
    with pytest.raises(ModelNotFoundError, match="holds no transformers PreTrainedModel"):
        fit(NoModel())


def test_two_models_need_model_attr():
    with pytest.raises(ModelNotFoundError, match="model_attr"):
        fit(TwoModels())
    trainer = fit(TwoModels(), strategy=LazyTrainStrategy(model_attr="model"))
    assert trainer.global_step == 1


def test_model_attr_that_is_not_a_model():
    with pytest.raises(ModelNotFoundError, match="lr"):
        fit(LMModule(tiny_model("qwen2")), strategy=LazyTrainStrategy(model_attr="lr"))


def test_unsupported_architecture_names_it_and_the_list():
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*Qwen2ForCausalLM"):
        fit(LMModule(gpt2))


def test_fp16_refused():
    # (on the CPU Lightning itself turns "16-mixed" into "bf16-mixed" before a strategy sees it)
    with pytest.raises(ValueError, match="fp16"):
        fit(LMModule(tiny_model("qwen2")), precision="16-true")
    with pytest.raises(ValueError, match="fp16"):
        lightning_lazytrain.LazyTrainPrecision("16-mixed")


def test_gpu_only_option_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        fit(LMModule(tiny_model("qwen2")), strategy=LazyTrainStrategy(pin_memory=True))


def test_bad_schedule_string():
    with pytest.raises(ValueError, match="interval:K"):
        LazyTrainStrategy(schedule="every other")


def test_too_few_slots_for_the_plan():
    with pytest.raises(ValueError, match="weight slots"):
        fit(LMModule(tiny_model("qwen2")), strategy=LazyTrainStrategy(schedule="interval:4", num_slots=2))


@pytest.mark.gpu
def test_model_that_cannot_fit_the_gpu_slots():
    from lightning_lazytrain.engine import DeviceTooSmallError

    # Sized from the card's total, not its free memory: memory freed between this line and the check (a previous
    # test's tensors collected, the allocator's cache emptied) must not let the slots fit, whatever the card.
    _, total = torch.cuda.mem_get_info()
    layer = sum(p.numel() for p in tiny_model("qwen2").model.layers[0].parameters()) * 4
    trainer = pl.Trainer(accelerator="gpu", strategy=LazyTrainStrategy(num_slots=int(total // layer) + 8),
                         max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    with pytest.raises(DeviceTooSmallError, match=r"weight slots of .* GiB free"):
        trainer.fit(LMModule(tiny_model("qwen2")), loader(batches(1)))


def test_strategy_from_lightning_cli_class_path():
    from lightning.pytorch.cli import LightningCLI

    class Tiny(LMModule):
        def __init__(self, family: str = "qwen2") -> None:
            super().__init__(tiny_model(family))

    cli = LightningCLI(Tiny, run=False, args={"trainer": {
        "accelerator": "cpu", "logger": False,
        "strategy": {"class_path": "lightning_lazytrain.LazyTrainStrategy",
                     "init_args": {"schedule": "interval:2", "keep_graph_layers": 1}}}})
    assert isinstance(cli.trainer.strategy, LazyTrainStrategy)
    assert cli.trainer.strategy.schedule == "interval:2"
    assert "lazytrain" in pl.strategies.StrategyRegistry
    assert lightning_lazytrain.LazyTrainStrategy is LazyTrainStrategy


def test_model_usable_after_fit():
    """Teardown gives the model back: plain HF forward on the CPU, same logits as the trained weights say."""
    start = tiny_model("qwen2")
    module = LMModule(copy.deepcopy(start))
    fit(module)
    ids = batches(1)[0]["input_ids"]
    out = module.model(input_ids=ids)
    # a model built afresh (no instance overrides a deepcopy would carry along) holding copies of the trained weights
    fresh = AutoModelForCausalLM.from_config(module.model.config)
    fresh.load_state_dict({k: v.clone() for k, v in module.model.state_dict().items()})
    ref = fresh(input_ids=ids)
    assert out.logits is not None and torch.equal(out.logits, ref.logits)
    assert not torch.allclose(out.logits, start(input_ids=ids).logits), "the step must have changed the logits"
    assert "forward" not in module.model.model.layers[0].__dict__


def test_demo_loss_falls(capsys):
    demo_main(["--steps", "40"])
    assert "lazytrain demo: loss" in capsys.readouterr().out


@pytest.mark.parametrize("share", [-0.1, 1.5, "auto"])
def test_device_update_share_out_of_range_names_the_range(share):
    expected = r"device_update_share must be in \[0, 1\], 'plan' \(the MILP's split\) or None"
    with pytest.raises(ValueError, match=expected):
        LazyTrainStrategy(device_update_share=share)


def test_device_update_states_names_the_choices():
    with pytest.raises(ValueError, match=r"device_update_states must be one of \('auto', 'resident', 'staged'\)"):
        LazyTrainStrategy(device_update_states="gpu")
