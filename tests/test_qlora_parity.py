"""QLoRA streamed by lazytrain against plain Lightning on the same bitsandbytes 4-bit peft model (its CPU ops)."""

import pytest
import torch
from helpers import batches, train
from lora_models import AdapterModule
from qlora_models import packed_base, tiny_qlora

from lightning_lazytrain.engine.weights.packed4bit import is_packed_4bit

CLIP = 0.05


def _adapters(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().double() for n, p in module.model.named_parameters() if p.requires_grad}


def _update_diff(start, a, b) -> float:
    """||(a - start) - (b - start)|| / ||b - start|| over the adapters."""
    s0 = {n: p.detach().double() for n, p in start.named_parameters() if p.requires_grad}
    sa, sb = _adapters(a), _adapters(b)
    num = sum(float((sa[k] - sb[k]).square().sum()) for k in sb)
    den = sum(float((sb[k] - s0[k]).square().sum()) for k in sb)
    return (num / den) ** 0.5


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_qlora_32_true_matches_plain_lightning(quant_type):
    model, data = tiny_qlora(quant_type), batches(3)
    assert sum(is_packed_4bit(p) for p in model.parameters()) == 4 * 7, "every linear layer of the 4 layers"
    ref, _ = train(model, data, module_cls=AdapterModule, gradient_clip_val=CLIP)
    lt, _ = train(model, data, strategy="lazytrain", module_cls=AdapterModule, gradient_clip_val=CLIP)
    assert _update_diff(model, lt, ref) <= 1e-4
    assert lt.losses == pytest.approx(ref.losses, rel=1e-5)
    before, after = packed_base(model), packed_base(lt.model)
    assert before.keys() == after.keys() and len(before) == 3 * 28
    assert all(torch.equal(after[k], before[k]) for k in before), "the 4-bit base is unchanged, byte for byte"
    for name, p in lt.model.named_parameters():
        if is_packed_4bit(p):
            assert p.dtype == torch.uint8 and p.grad is None, name


def test_qlora_bf16_mixed_within_bf16_noise_of_plain():
    """Plain bf16-mixed keeps fp32 biases and norms inside autocast, lazytrain streams them in bf16: the tolerance
    is the bf16 noise floor (plain bf16-mixed against plain fp32), with a factor 2 of headroom."""
    model, data = tiny_qlora("nf4", compute_dtype=torch.bfloat16), batches(3)
    ref32, _ = train(model, data, module_cls=AdapterModule, gradient_clip_val=CLIP)
    ref16, _ = train(model, data, module_cls=AdapterModule, gradient_clip_val=CLIP, precision="bf16-mixed")
    lt16, _ = train(model, data, strategy="lazytrain", module_cls=AdapterModule, gradient_clip_val=CLIP,
                    precision="bf16-mixed")
    noise = _update_diff(model, ref16, ref32)
    assert 0 < noise < 0.5
    assert _update_diff(model, lt16, ref16) <= 2 * noise
    assert lt16.losses == pytest.approx(ref16.losses, rel=2e-2)
