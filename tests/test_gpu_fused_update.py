"""The Triton AdamW kernel of the device path against the CPU kernel, on a CUDA device."""

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
def test_fused_update_gives_the_cpu_kernels_numbers(eight_bit, master, n):
    """Bit for bit: the device share of the updates must not drift from the CPU's (Adam's first steps amplify an
    ulp into a different update, so "close" is not enough)."""
    from lightning_lazytrain.engine.updates.device_kernel import update_kernel
    from lightning_lazytrain.optim import kernel
    from lightning_lazytrain.optim.triton_adamw import fused_step

    p, g, state, scalars = _case(n, eight_bit, master, 4096)
    new_p, new_g, new_s = _on("cuda", p, g, state)
    assert update_kernel(new_p, new_s, scalars["block"]) is fused_step
    copy = torch.empty(n, dtype=torch.bfloat16) if master == torch.float32 else None
    new_c = torch.empty(n, dtype=torch.bfloat16, device="cuda") if copy is not None else None
    before = p.clone()
    kernel.run_step(param=p, grad=g, m=state.get("exp_avg"), v=state.get("exp_avg_sq"), mq=state.get("exp_avg_codes"),
                    vq=state.get("exp_avg_sq_codes"), mabs=state.get("exp_avg_absmax"),
                    vabs=state.get("exp_avg_sq_absmax"), nthreads=2, copy=copy, **scalars)
    fused_step(param=new_p, grad=new_g, state=new_s, copy=new_c, **scalars)
    assert not torch.equal(p, before)
    assert torch.equal(new_p.cpu(), p), f"{(new_p.cpu() != p).sum().item()} of {n} masters differ"
    if copy is not None:
        assert torch.equal(new_c.cpu(), copy)
    for name, t in state.items():
        assert torch.equal(new_s[name].cpu(), t), f"{name}: {(new_s[name].cpu() != t).sum().item()} differ"


def test_fused_update_falls_back_where_it_cannot_run():
    from lightning_lazytrain.engine.updates.device_kernel import update_kernel

    p, g, state, scalars = _case(4096, True, torch.float32, 4096)
    cpu_state = dict(state)
    assert update_kernel(p, cpu_state, 4096) is reference_step  # CPU tensors
    cuda_p, _, cuda_state = _on("cuda", p, g, state)
    assert update_kernel(cuda_p, cuda_state, 1000) is reference_step  # a block that is not a power of two
