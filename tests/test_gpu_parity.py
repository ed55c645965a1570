"""The same parity on a CUDA device: streams, events, pinned buffers and the gradient worker in play."""

import pytest
from helpers import batches, rel_diff, tiny_model, train, update_rel_diff

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen2", "qwen2-tied", "qwen3-moe", "qwen3.5"])
@pytest.mark.parametrize("schedule", ["interval:1", "interval:2"])
def test_gpu_fp32_matches_plain(family, schedule):
    model, data = tiny_model(family), batches(3, padded=True)
    ref, _ = train(model, data, accelerator="gpu")
    lt, _ = train(model, data, accelerator="gpu", strategy=LazyTrainStrategy(schedule=schedule, keep_graph_layers=1))
    # cuBLAS may pick different kernels for the slot-bound weights, so fp32 rounding differs more than on the CPU
    assert rel_diff(lt.model.cpu(), ref.model.cpu()) <= 1e-5


def test_gpu_bf16_mixed_close_to_plain():
    model, data = tiny_model("qwen2"), batches(3)
    ref32, _ = train(model, data, accelerator="gpu")
    ref16, _ = train(model, data, accelerator="gpu", precision="bf16-mixed")
    lt16, _ = train(model, data, accelerator="gpu", precision="bf16-mixed", strategy="lazytrain")
    noise = update_rel_diff(model, ref16.model.cpu(), ref32.model.cpu())
    assert 0 < noise < 0.5, "the bf16 noise floor itself must be small for 2x of it to mean anything"
    assert update_rel_diff(model, lt16.model.cpu(), ref16.model.cpu()) <= 2 * noise


@pytest.mark.parametrize("fraction", [0.0, 1.0])
@pytest.mark.parametrize("share", [0.5, 1.0])
def test_gpu_device_updates_match_cpu_updates(fraction, share):
    """Updates on the GPU (gradients kept there; masters and states resident there, the default on CUDA, and
    written back at teardown) give the CPU kernel's numbers."""
    import copy

    import lightning.pytorch as pl
    from helpers import loader
    from test_engine_updates import HybridModule

    model, data = tiny_model("qwen2"), batches(3)
    out = []
    for s in (0.0, share):
        module = HybridModule(copy.deepcopy(model), fraction)
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=LazyTrainStrategy(device_update_share=s),
                             max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, gradient_clip_val=0.05)
        trainer.fit(module, loader(data))
        out.append((module, trainer.strategy.last_step_stats))
    (cpu, _), (dev, stats) = out
    assert stats["device_update_launch_s"] > 0
    assert rel_diff(cpu.model.cpu(), model) > 1e-3
    assert rel_diff(dev.model.cpu(), cpu.model.cpu()) <= 1e-5


@pytest.mark.parametrize("states", ["staged", "resident"])
@pytest.mark.parametrize("share", [0.5, "plan"])
def test_gpu_device_updates_write_the_streamed_copy_under_bf16_mixed(share, states):
    """bf16-mixed, 8-bit states: the device path (staged: two units in flight, copies in and out on their own
    streams; resident: masters and states kept on the device, written back when drained) against every update on
    the CPU kernel, which the Triton kernel matches bit for bit; a stale bf16 copy or a unit read before its copy
    out ended differs by ~1e-3.
    ``"plan"``: the MILP's split from the measured link and CPU rate (it may pick no unit for so small a model; the
    fixed share must run some)."""
    import copy

    from test_engine_updates import BusySeconds, HybridModule, fit

    model, data = tiny_model("qwen2"), batches(3)
    busy = BusySeconds()
    cpu, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data, LazyTrainStrategy(device_update_share=0.0),
                 precision="bf16-mixed", accelerator="gpu", gradient_clip_val=0.05)
    dev, _ = fit(HybridModule(copy.deepcopy(model), 1.0), data,
                 LazyTrainStrategy(device_update_share=share, device_update_states=states),
                 precision="bf16-mixed", accelerator="gpu", gradient_clip_val=0.05, callbacks=[busy])
    if share != "plan":
        assert busy.device > 0
    assert rel_diff(cpu.model.cpu(), model) > 1e-2
    assert rel_diff(dev.model.cpu(), cpu.model.cpu()) <= 1e-5


def test_gpu_layer_gradients_leave_the_device_during_the_backward():
    """Each layer's weight gradients are freed once their copy to the host has run: after the backward, what the
    run allocates beyond its weight slots and resident embedding/head is well under the 24 layers' gradients
    together (holding them until the update kept 2 bytes per parameter of the whole model on the device, beyond
    anything a plan counts). The slots are left out because a plan that keeps every graph on a large GPU sizes the
    pool at one slot per layer, as large as the gradients themselves. The layers are wide enough (0.7 GB of bf16
    gradients) that cuBLAS's per-stream workspaces (32 MiB each on Hopper, from the same allocator) stay well under
    the bound."""
    import lightning.pytorch as pl
    import torch
    from test_engine_updates import HybridModule, fit
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=8, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    layer_grad_bytes = 2 * sum(p.numel() for p in model.model.layers.parameters())
    seen = {}

    class AfterBackward(pl.Callback):
        def on_after_backward(self, trainer, module):
            torch.cuda.synchronize()
            torch.empty(1, device="cuda")  # a malloc lets the allocator take back blocks whose streams are done
            executor = trainer.strategy.executor
            held = executor.pool.nbytes + executor.resident_device_bytes
            seen.setdefault("allocated", torch.cuda.memory_allocated() - seen["before"] - held)

    torch.cuda.empty_cache()
    seen["before"] = torch.cuda.memory_allocated()
    fit(HybridModule(model, 1.0), batches(2), LazyTrainStrategy(device_update_share=0), precision="bf16-mixed",
        accelerator="gpu",
        max_steps=1, callbacks=[AfterBackward()])
    assert seen["allocated"] < 0.5 * layer_grad_bytes, (seen, layer_grad_bytes)
