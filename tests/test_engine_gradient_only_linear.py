"""The backward's re-run skips the MLP's output projection (`engine/compute/gradient_only_linear.py`): bit for bit the
plain layer's gradients on the CPU, one matmul fewer, and only where the output projection is a plain, unhooked
linear."""

import pytest
import torch
from helpers import FAMILIES, batches, rel_diff, tiny_model, train
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_lazytrain  # noqa: F401
from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.engine.compute import gradient_only_linear
from lightning_lazytrain.engine.compute.gradient_only_linear import mlp_output_skipped, skips_mlp_output
from lightning_lazytrain.models import adapter_for
from lightning_lazytrain.schedule import Schedule
from lightning_lazytrain.schedule.timing import rotary_inputs

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class _MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def _inputs(model, batch: int = 2, seq: int = 16):
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(batch, seq, model.config.hidden_size, generator=gen)
    pos, pe = rotary_inputs(model.model.rotary_emb, h, batch, seq)
    kwargs = {"attention_mask": None, "position_ids": pos, "position_embeddings": pe}
    return h, kwargs, torch.randn(h.shape, generator=gen)


def _grads(layer, h, kwargs, grad, skipped: bool):
    x = h.detach().requires_grad_()
    params = list(layer.parameters())
    with mlp_output_skipped(layer) if skipped else torch.enable_grad():
        out = layer(x, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return torch.autograd.grad(out, [x, *params], grad, allow_unused=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_kind_gets_the_plain_gradients(family):
    model = tiny_model(family)
    h, kwargs, grad = _inputs(model)
    kinds = {t: j for j, t in reversed(list(enumerate(adapter_for(model).layer_types())))}
    for j in kinds.values():
        layer = model.model.layers[j]
        plain = _grads(layer, h, kwargs, grad, skipped=False)
        skipped = _grads(layer, h, kwargs, grad, skipped=True)
        for a, b in zip(plain, skipped, strict=True):
            assert (a is None) == (b is None)
            if a is not None:  # the same ops as F.linear's backward, in the same order: the same bits
                assert torch.equal(b, a)
        assert "forward" not in layer.mlp.__dict__.get("down_proj", layer.mlp).__dict__


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3.5"])
def test_the_output_projection_is_not_multiplied(family):
    model = tiny_model(family)
    layer = model.model.layers[0]
    h, kwargs, _ = _inputs(model)
    assert skips_mlp_output(layer)
    counts = []
    for skipped in (False, True):
        with torch.enable_grad(), _MatmulCount() as mode, mlp_output_skipped(layer) if skipped else torch.no_grad():
            layer(h.detach().requires_grad_(), **kwargs)
        counts.append(mode.count)
    assert counts[1] == counts[0] - 1


def test_a_hooked_or_wrapped_projection_runs_unchanged():
    model = tiny_model("qwen2")
    layer = model.model.layers[0]
    h, kwargs, _ = _inputs(model)
    seen = []
    handle = layer.mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(out.sum().item()))
    assert not skips_mlp_output(layer)
    with torch.no_grad(), mlp_output_skipped(layer):
        out = layer(h, **kwargs)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(out, layer(h, **kwargs)) and seen[0] != 0.0
    assert not skips_mlp_output(tiny_model("qwen3-moe").model.layers[0])  # a sparse block: no one output projection


def test_bf16_autocast_over_fp32_weights_matches_plain_autocast():
    model = tiny_model("qwen2")
    layer = model.model.layers[0]
    h, kwargs, grad = _inputs(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _grads(layer, h, kwargs, grad, skipped=False)
        skipped = _grads(layer, h, kwargs, grad, skipped=True)
    for a, b in zip(plain, skipped, strict=True):
        assert a.dtype == b.dtype and torch.equal(b, a)


def test_the_engine_skips_it_in_each_rerun_only(tmp_path, monkeypatch):
    """Layers 0-1 re-run (boundary 1 dropped: layer 0 re-runs twice, once without grad), 2 keeps its graph, 3
    re-runs: three grad re-runs a step skip the product; training still matches plain training."""
    calls = []
    real = gradient_only_linear.GradientOnlyLinear.apply
    monkeypatch.setattr(gradient_only_linear.GradientOnlyLinear, "apply",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    plan = tmp_path / "plan.json"
    tiers = ["gpu", "recompute", "gpu", "gpu", "gpu"]
    plan.write_text(Schedule(homes=tiers, keep_graph=[False, False, True, False]).to_json())
    model, data = tiny_model("qwen2"), batches(3)
    plain, _ = train(model, data)
    lt, _ = train(model, data, strategy=LazyTrainStrategy(schedule=str(plan)))
    assert len(lt.losses) == 3 and len(calls) == 3 * 3
    assert rel_diff(lt.model, plain.model) <= 1e-5
    assert lt.losses == pytest.approx(plain.losses, rel=1e-6)
