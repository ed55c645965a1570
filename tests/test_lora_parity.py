"""LoRA streamed by lazytrain against plain Lightning on the same peft model, data and optimizer, clipping on."""

import pytest
import torch
from helpers import batches, train
from lora_models import AdapterModule, HybridAdapterModule, tiny_lora

CLIP = 0.05


def _adapters(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double() for n, p in module.model.named_parameters() if p.requires_grad}


def _update_diff(start, a, b) -> float:
    """||(a - start) - (b - start)|| / ||b - start|| over the adapters: how far apart the two runs' updates are."""
    s0, sa, sb = _adapters(start), _adapters(a), _adapters(b)
    num = sum(float((sa[k] - sb[k]).square().sum()) for k in sb)
    den = sum(float((sb[k] - s0[k]).square().sum()) for k in sb)
    return (num / den) ** 0.5


class _Start:
    """The module view of the untrained model, for ``_update_diff``."""

    def __init__(self, model) -> None:
        self.model = model


@pytest.mark.parametrize("module_cls", [AdapterModule, HybridAdapterModule], ids=["torch-adamw", "hybrid-adamw"])
def test_lora_32_true_with_clipping_matches_plain(module_cls):
    model, data = tiny_lora(), batches(3)
    ref, _ = train(model, data, module_cls=module_cls, gradient_clip_val=CLIP)
    lt, _ = train(model, data, strategy="lazytrain", module_cls=module_cls, gradient_clip_val=CLIP)
    unclipped, _ = train(model, data, module_cls=module_cls)
    assert _update_diff(_Start(model), unclipped, ref) > 1e-2, "clipping must change this run"
    assert _update_diff(_Start(model), lt, ref) <= 1e-4
    assert lt.losses == pytest.approx(ref.losses, rel=1e-5)
    frozen = [(n, p) for n, p in lt.model.named_parameters() if not p.requires_grad]
    start = dict(model.named_parameters())
    assert all(torch.equal(p, start[n]) for n, p in frozen), "no frozen weight moved"


def test_lora_bf16_mixed_with_clipping_within_bf16_noise_of_plain():
    """The plain bf16-mixed run keeps an fp32 base inside autocast, lazytrain streams a bf16 one: the tolerance is
    the bf16 noise floor itself (plain bf16-mixed against plain fp32), with a factor 2 of headroom."""
    model, data = tiny_lora(), batches(3)
    ref32, _ = train(model, data, module_cls=AdapterModule, gradient_clip_val=CLIP)
    ref16, _ = train(model, data, module_cls=AdapterModule, gradient_clip_val=CLIP, precision="bf16-mixed")
    lt16, _ = train(model, data, strategy="lazytrain", module_cls=AdapterModule, gradient_clip_val=CLIP,
                    precision="bf16-mixed")
    noise = _update_diff(_Start(model), ref16, ref32)
    assert 0 < noise < 0.5
    assert _update_diff(_Start(model), lt16, ref16) <= 2 * noise
    assert lt16.losses == pytest.approx(ref16.losses, rel=2e-2)
