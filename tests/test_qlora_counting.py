"""A QLoRA run's bytes as admission and ``lazytrain plan`` count them against what the store holds: fp32 masters,
gradients and states for the adapters only, the frozen bf16 parameters at 2 bytes, the 4-bit base as its packed
codes and quant state."""

import pytest
from helpers import batches, tiny_config, train
from lora_models import HybridAdapterModule
from qlora_models import tiny_qlora
from test_lora_store import _Bytes, _Seen

import lightning_lazytrain.admission.measure as admission
from lightning_lazytrain.engine.weights.packed4bit import is_packed_4bit
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.schedule.forecast import Machine, RunSpec, _host_report
from lightning_lazytrain.schedule.gpus import GPUS
from lightning_lazytrain.sft.lora import LoraOptions, add_adapters
from lightning_lazytrain.sft.plan_model import meta_model


class _Units(_Bytes):
    def on_train_batch_end(self, trainer, *args) -> None:
        super().on_train_batch_end(trainer, *args)
        units = trainer.strategy.executor.store.units
        self.layer_bytes = [u.numel * u.stream.element_size() for u in units[1:]]


def _kinds(model) -> tuple[int, int, int]:
    """(trainable, frozen bf16-held, frozen 4-bit) parameter counts; a 4-bit weight counts its unpacked size."""
    params = list(model.parameters())
    four = sum(p.quant_state.shape.numel() for p in params if is_packed_4bit(p))
    frozen = sum(p.numel() for p in params if not p.requires_grad and not is_packed_4bit(p))
    return sum(p.numel() for p in params if p.requires_grad), frozen, four


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_admission_and_plan_count_what_the_store_holds(monkeypatch, quant_type):
    seen = _Seen(monkeypatch)
    model = tiny_qlora(quant_type)
    trained, frozen, four = _kinds(model)
    held = _Units()
    train(model, batches(1), strategy="lazytrain", precision="bf16-mixed", max_steps=1,
          module_cls=HybridAdapterModule, callbacks=[held])
    pieces = admission.admission_report(**seen.kw).tiers["host"].pieces
    assert pieces["master weights"] == 4 * trained and pieces["streamed bf16 copy"] == 2 * trained
    assert pieces["gradients"] == 2 * trained == held.sink, "no gradient for any frozen weight"
    assert pieces["frozen weights"] == 2 * frozen
    packed = pieces["4-bit frozen weights"]
    assert four / 2 < packed < 0.75 * four, "half a byte per 4-bit weight plus its quant state, far below bf16"
    weights = ("master weights", "streamed bf16 copy", "frozen weights", "4-bit frozen weights")
    assert held.store == sum(pieces[k] for k in weights), "the weight pieces are exactly what the store holds"

    # lazytrain plan's count, on the meta device where nothing is quantized, is the same to the byte
    plan_model = meta_model(tiny_config("qwen2"))
    add_adapters(plan_model, LoraOptions(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    run = RunSpec(adapter_for(plan_model), seq=16, precision="bf16-mixed", quantize=quant_type)
    counts = run.counts
    assert (counts.trainable_params, counts.frozen_params, counts.frozen_4bit_params) == (trained, frozen, four)
    assert counts.frozen_4bit_bytes == packed
    assert counts.layer_stream_bytes == held.layer_bytes and run.slot_bytes == max(held.layer_bytes)
    report = run_report(run)
    assert report["4-bit frozen weights"] == packed and report["frozen weights"] == 2 * frozen
    assert report["master weights"] == 4 * trained


def run_report(run: RunSpec) -> dict[str, int]:
    """The host pieces ``lazytrain plan`` reports for ``run``."""
    return _host_report(run, Machine(GPUS["h200"], 1 << 40)).tiers["host"].pieces


def test_a_bf16_lora_plan_counts_the_adapters_as_trainable():
    model = meta_model(tiny_config("qwen2"))
    total = sum(p.numel() for p in model.parameters())
    add_adapters(model, LoraOptions(r=4, target_modules=["q_proj", "v_proj"]))
    run = RunSpec(adapter_for(model), seq=16, precision="bf16-mixed")
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert run.trainable_params == adapters and run.counts.frozen_params == total
    assert run.counts.frozen_4bit_bytes == 0
    assert run.slot_bytes == 2 * max(sum(p.numel() for p in layer.parameters()) for layer in run.adapter.layers)
    assert run_report(run)["frozen weights"] == 2 * total
