"""The Triton AdamW kernel of the device path against the torch reference it replaces, on a CUDA device."""

import pytest
import torch

from lightning_lazytrain.optim.quant import quantize_blockwise
from lightning_lazytrain.optim.reference import reference_step, v_floor_coef

pytestmark = pytest.mark.gpu


def _case(n: int, eight_bit: bool, master: torch.dtype, block: int) -> tuple:
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen).to(master)
    g = (torch.randn(n, generator=gen) * 1e-2).to(torch.bfloat16)
    m, v = torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-5
    if eight_bit:
        mc, ma = quantize_blockwise(m, True, block)
        vc, va = quantize_blockwise(v, False, block)
        state = {"exp_avg_codes": mc, "exp_avg_sq_codes": vc, "exp_avg_absmax": ma, "exp_avg_sq_absmax": va}
    else:
        state = {"exp_avg": m, "exp_avg_sq": v}
    step = 7
    scalars = dict(block=block, decay=1 - 1e-3 * 0.01, beta1=0.9, beta2=0.999, neg_step=-1e-3 / (1 - 0.9**step),
                   bc2_sqrt=(1 - 0.999**step) ** 0.5, eps=1e-8, grad_scale=0.37, sr_key=0xC0FFEE42,
                   v_floor=v_floor_coef(0.9, 0.999, step) if eight_bit else 0.0)
    return p, g, state, scalars


def _on(device: str, p, g, state):
    return p.to(device), g.to(device), {k: t.to(device) for k, t in state.items()}


@pytest.mark.parametrize("eight_bit", [True, False])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096 * 3, 4096 * 5 + 1234])  # whole blocks, and a ragged last block
def test_fused_update_matches_the_reference(eight_bit, master, n):
    from lightning_lazytrain.engine.updates.device import update_kernel
    from lightning_lazytrain.optim.triton_adamw import fused_step

    p0, g0, s0, scalars = _case(n, eight_bit, master, 4096)
    ref_p, g, ref_s = _on("cuda", p0, g0, s0)
    new_p, _, new_s = _on("cuda", p0, g0, s0)
    assert update_kernel(new_p, new_s, scalars["block"]) is fused_step
    with_copy = master == torch.float32
    ref_c = torch.empty(n, dtype=torch.bfloat16, device="cuda") if with_copy else None
    new_c = torch.empty(n, dtype=torch.bfloat16, device="cuda") if with_copy else None
    reference_step(param=ref_p, grad=g, state=ref_s, copy=ref_c, **scalars)
    fused_step(param=new_p, grad=g, state=new_s, copy=new_c, **scalars)
    moved = (ref_p.float() - p0.cuda().float()).abs()
    assert moved.max() > 0
    if master == torch.float32:
        # an fp32 update differs by at most a few ulps of the weight (a fused multiply-add), far below the step
        assert ((new_p - ref_p).abs() <= 4 * torch.finfo(torch.float32).eps * ref_p.abs()).all()
        assert torch.equal(new_c, new_p.to(torch.bfloat16)), "the stream copy is the master rounded to nearest"
    else:
        # stochastic rounding: the same hash gives the same bf16 except where the fp32 value sits on a boundary
        assert (new_p != ref_p).float().mean() <= 1e-3
    for name, ref in ref_s.items():
        new = new_s[name]
        if ref.dtype == torch.uint8:
            diff = (new.int() - ref.int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() <= 1e-3, name
        else:
            assert torch.allclose(new, ref, rtol=1e-5, atol=1e-12), name


def test_fused_update_falls_back_where_it_cannot_run():
    from lightning_lazytrain.engine.updates.device import update_kernel

    p, g, state, scalars = _case(4096, True, torch.float32, 4096)
    cpu_state = dict(state)
    assert update_kernel(p, cpu_state, 4096) is reference_step  # CPU tensors
    cuda_p, _, cuda_state = _on("cuda", p, g, state)
    assert update_kernel(cuda_p, cuda_state, 1000) is reference_step  # a block that is not a power of two
