"""QLoRA on a CUDA device: the 4-bit base streamed through pinned buffers and device slots and dequantized by
bitsandbytes' CUDA kernels, against plain Lightning moving the same bitsandbytes model to the GPU."""

import pytest
import torch
from helpers import batches, train
from lora_models import AdapterModule
from qlora_models import packed_base, tiny_qlora
from test_qlora_parity import CLIP, _update_diff

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_gpu_qlora_32_true_matches_plain(quant_type):
    model, data = tiny_qlora(quant_type), batches(3)
    ref, _ = train(model, data, accelerator="gpu", module_cls=AdapterModule, gradient_clip_val=CLIP)
    lt, _ = train(model, data, accelerator="gpu", strategy="lazytrain", module_cls=AdapterModule,
                  gradient_clip_val=CLIP)
    # cuBLAS may pick other kernels for the slot-bound weights, so fp32 rounding differs more than on the CPU
    assert _update_diff(model, lt.cpu(), ref.cpu()) <= 1e-3
    before, after = packed_base(model), packed_base(lt.model)
    assert all(torch.equal(after[k].cpu(), before[k]) for k in before), "the 4-bit base is unchanged"


def test_gpu_qlora_bf16_mixed_within_bf16_noise_of_plain():
    model, data = tiny_qlora("nf4", compute_dtype=torch.bfloat16), batches(3)
    ref32, _ = train(model, data, accelerator="gpu", module_cls=AdapterModule, gradient_clip_val=CLIP)
    ref16, _ = train(model, data, accelerator="gpu", module_cls=AdapterModule, gradient_clip_val=CLIP,
                     precision="bf16-mixed")
    lt16, _ = train(model, data, accelerator="gpu", strategy="lazytrain", module_cls=AdapterModule,
                    gradient_clip_val=CLIP, precision="bf16-mixed")
    noise = _update_diff(model, ref16.cpu(), ref32.cpu())
    assert 0 < noise < 0.5
    assert _update_diff(model, lt16.cpu(), ref16.cpu()) <= 2 * noise
