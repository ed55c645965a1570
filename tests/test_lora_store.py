"""A LoRA run's host store holds the frozen base once, as the copy it streams, and admission counts that."""

import collections

import lightning.pytorch as pl
import pytest
import torch
from helpers import batches, train
from lora_models import AdapterModule, HybridAdapterModule, tiny_lora, trainable_and_frozen

import lightning_lazytrain.admission.measure as admission

Mem = collections.namedtuple("Mem", "available")
_AVAILABLE = 1 << 40


class _Seen:
    """What the strategy's admission check was asked, and the store and sink after the run."""

    def __init__(self, monkeypatch) -> None:
        self.kw: dict = {}
        real = admission.admission_report

        def spy(**kw):
            self.kw.update(kw)
            return real(**kw)

        monkeypatch.setattr(admission, "admission_report", spy)
        monkeypatch.setattr(admission.psutil, "virtual_memory", lambda: Mem(available=_AVAILABLE))

    @property
    def held(self) -> int:
        return self.kw["host_have_bytes"] - _AVAILABLE


class _Bytes(pl.Callback):
    """The store's and the gradient sink's host bytes after the first step (the executor is gone after fit)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        executor = trainer.strategy.executor
        self.store, self.sink = executor.store.held_bytes, executor.sink.held_bytes()
        self.streams = {u.stream.untyped_storage().data_ptr() for u in executor.store.units}


@pytest.mark.parametrize(("module_cls", "grad_bytes"), [(HybridAdapterModule, 2), (AdapterModule, 4)],
                         ids=["engine-update-bf16-grads", "torch-adamw-fp32-grads"])
def test_bf16_mixed_store_holds_the_frozen_base_once_in_bf16(monkeypatch, module_cls, grad_bytes):
    seen = _Seen(monkeypatch)
    model = tiny_lora()
    trained, frozen = trainable_and_frozen(model)
    assert frozen > 50 * trained
    held = _Bytes()
    module, trainer = train(model, batches(1), strategy="lazytrain", precision="bf16-mixed", max_steps=1,
                            module_cls=module_cls, callbacks=[held])
    assert held.store == 4 * trained + 2 * (trained + frozen)
    assert held.sink == grad_bytes * trained
    report = admission.admission_report(**seen.kw)
    pieces = report.tiers["host"].pieces
    assert pieces["master weights"] == 4 * trained and pieces["frozen weights"] == 2 * frozen
    assert pieces["streamed bf16 copy"] == 2 * trained and pieces["gradients"] == grad_bytes * trained
    # the report's weight pieces are what the store holds, and the setup's measure of the run's holdings saw it
    assert held.store == pieces["master weights"] + pieces["streamed bf16 copy"] + pieces["frozen weights"]
    assert seen.held >= held.store
    for p in module.model.parameters():
        if not p.requires_grad:
            assert p.dtype == torch.bfloat16 and p.grad is None
            assert p.untyped_storage().data_ptr() in held.streams


def test_32_true_store_keeps_one_buffer_and_no_frozen_gradients(monkeypatch):
    seen = _Seen(monkeypatch)
    model = tiny_lora()
    trained, frozen = trainable_and_frozen(model)
    held = _Bytes()
    module, _ = train(model, batches(1), strategy="lazytrain", max_steps=1, module_cls=AdapterModule, callbacks=[held])
    assert held.store == 4 * (trained + frozen)
    assert held.sink == 4 * trained
    assert seen.kw["num_params"] == trained and seen.kw["frozen_params"] == frozen
    assert all(p.grad is None for p in module.model.parameters() if not p.requires_grad)


class _DeviceShare(pl.Callback):
    """What the device-update share would move and hold for each unit, read after the first step."""

    def on_train_batch_end(self, trainer, *args) -> None:
        from lightning_lazytrain.engine.updates.device import staging_bytes
        from lightning_lazytrain.engine.updates.traffic import unit_traffic

        executor = trainer.strategy.executor
        opt = executor.path.optimizer
        self.rows = [(unit_traffic(u, opt, 2, False, torch.device("cpu")).numel, staging_bytes(u, opt),
                      sum(e.numel for e in u.trained), sum(e.numel for e in u.unique)) for u in executor.store.units]


def test_a_device_update_moves_and_stages_the_adapters_only():
    """A device-updated LoRA unit copies and stages its adapters' masters and states, not its frozen base: each
    trained element needs at most its fp32 master, two fp32 states and a bf16 copy (4 + 8 + 2 bytes) plus the
    alignment of a few tensors, far below one byte per frozen element."""
    seen = _DeviceShare()
    train(tiny_lora(), batches(1), strategy="lazytrain", precision="bf16-mixed", max_steps=1,
          module_cls=HybridAdapterModule, callbacks=[seen])
    layers = [r for r in seen.rows if r[2] < r[3]]  # the units holding frozen weights
    assert layers
    for numel, staged, trained, everything in layers:
        assert numel == trained
        assert 14 * trained <= staged <= 14 * trained + 4096 < everything


def test_the_update_plan_times_a_lora_units_next_forward_by_its_whole_streamed_copy():
    """The update MILP waits on each unit's next forward, which streams the frozen base as well as the adapters:
    timing it by the adapters' bytes alone made a LoRA forward look nearly free."""
    from lightning_lazytrain.planning.update_placement import update_problem

    seen = _Traffic()
    train(tiny_lora(), batches(1), strategy="lazytrain", precision="bf16-mixed", max_steps=1,
          module_cls=HybridAdapterModule, callbacks=[seen])
    problem = update_problem(seen.traffic, cpu_params_per_s=1e9, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    for t, forward_s, numel in zip(seen.traffic, problem.forward_seconds, seen.numels):
        assert forward_s == 2 * numel / 1e9  # every element of the unit, in bf16
        assert t.grad_bytes < t.stream_bytes or t.grad_bytes == 2 * numel


class _Traffic(pl.Callback):
    def on_train_batch_end(self, trainer, *args) -> None:
        from lightning_lazytrain.engine.updates.traffic import unit_traffic

        executor = trainer.strategy.executor
        units = executor.store.units
        self.traffic = [unit_traffic(u, executor.path.optimizer, 2, False, torch.device("cpu")) for u in units]
        self.numels = [u.numel for u in units]
