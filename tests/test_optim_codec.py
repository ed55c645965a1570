"""The 8-bit codec against bitsandbytes' blockwise format, and stochastic rounding."""

import bitsandbytes.functional as F  # the reference format; the test extra installs it
import pytest
import torch

from lightning_lazytrain.optim.kernel import fast_encoder, find_compiler, kernel_encode, runnable_paths
from lightning_lazytrain.optim.quant import (
    dequantize_blockwise,
    dynamic_map,
    encode_normalized,
    nearest_code,
    quant_tables,
    quantize_blockwise,
)
from lightning_lazytrain.optim.reference import stochastic_round_bf16


@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_bitsandbytes_maps(signed):
    assert torch.equal(dynamic_map(signed), F.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("signed", [True, False])
def test_codes_are_nearest(signed):
    code, _ = quant_tables(signed)
    g = torch.Generator().manual_seed(0)
    y = torch.rand(200_000, generator=g) * (2 if signed else 1) - (1 if signed else 0)
    y = torch.cat([y * torch.rand(200_000, generator=g) ** 6, code])  # every decade, and the code values
    codes, absmax = quantize_blockwise(y.clamp(-1, 1), signed, block_size=len(y))
    assert absmax.item() == 1.0
    assert torch.equal(codes.long(), nearest_code(y.clamp(-1, 1), code))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [256, 4096])
def test_roundtrip_against_bitsandbytes(signed, block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5 * block + 77, generator=g) * torch.rand(5 * block + 77, generator=g) ** 3
    if not signed:
        x = x.square()
    code = dynamic_map(signed)
    codes, absmax = quantize_blockwise(x, signed, block)
    b_codes, b_state = F.quantize_blockwise(x, code=code, blocksize=block)
    assert torch.equal(absmax, b_state.absmax)
    # Same format: bitsandbytes decodes our codes to exactly our values, and we decode its codes to its values.
    b_state_ours = F.QuantState(absmax=absmax, code=code, blocksize=block, dtype=torch.float32)
    ours = dequantize_blockwise(codes, absmax, signed, block)
    assert torch.equal(F.dequantize_blockwise(codes, b_state_ours), ours)
    assert torch.equal(
        dequantize_blockwise(b_codes, b_state.absmax, signed, block), F.dequantize_blockwise(b_codes, b_state)
    )
    # Codes agree except where bitsandbytes' CPU search is not nearest (tiny values); ours are never farther.
    xn = x / absmax.repeat_interleave(block)[: x.numel()]
    err_ours = (xn - code[codes.long()]).abs()
    err_bnb = (xn - code[b_codes.long()]).abs()
    assert bool((err_ours <= err_bnb + 1e-7).all())
    big = xn.abs() > 0.05  # away from the smallest decades both pick the same code almost everywhere
    assert (codes[big] != b_codes[big]).float().mean() < 1e-2  # measured <= 0.4%: near-ties
    assert (ours - x).abs().max() <= 0.05 * x.abs().max()


def test_stochastic_rounding_unbiased_and_deterministic():
    x = torch.full((200_000,), 1.0 + 2**-9)  # one quarter of the way from bf16 1.0 to the next value, 1 + 2^-7
    r = stochastic_round_bf16(x, key=1234).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5  # rounds up ~25% of the time: unbiased
    assert torch.equal(stochastic_round_bf16(x, key=1234), stochastic_round_bf16(x, key=1234))
    assert not torch.equal(stochastic_round_bf16(x, key=1234), stochastic_round_bf16(x, key=1235))
    y = torch.randn(100_000)
    ry = stochastic_round_bf16(y, key=9).float()
    lo = y.to(torch.bfloat16).float()  # each result is one of the two neighbours of y
    assert bool(((ry - y).abs() <= (lo - y).abs() + lo.abs() * 2**-7).all())
    assert abs((ry - y).mean().item()) < 5e-5  # no bias overall (round-to-nearest has none either, but SR
    # additionally preserves small updates:)
    tiny = torch.full((100_000,), 1.0) + 1e-4
    assert abs(stochastic_round_bf16(tiny, key=3).float().mean().item() - (1.0 + 1e-4)) < 2e-5
    assert tiny.to(torch.bfloat16).float().mean().item() == 1.0


def _encoder_cases(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Values to encode, shuffled, and which of them lie within 8 ulps of a threshold (where the threshold rule,
    not a float distance comparison, is the specification: thresholds are fp32 midpoints)."""
    code, thr = quant_tables(signed)
    t = thr[:255]
    g = torch.Generator().manual_seed(2)
    near = [t]  # every threshold and its 8 float neighbours on each side: the ties and near-ties
    for direction in (float("inf"), float("-inf")):
        step = t
        for _ in range(8):
            step = torch.nextafter(step, torch.tensor(direction))
            near.append(step)
    near = torch.cat(near)
    # zero, absmax (and one ulp above), denormals, the smallest normal, tiny, large and non-finite values
    special = torch.tensor([0.0, 1.0, 1.0 + 2**-23, 1e-45, 1e-40, 2**-126, 1e-30, 3.0, 1e30, float("inf")])
    nans = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, -0x7FFFFF], dtype=torch.int32).view(torch.float32)  # payloads
    special = torch.cat([special, -special, torch.tensor([float("nan")]), nans])
    uniform = torch.rand(300_000, generator=g) * 2 - 1
    decades = uniform * 10.0 ** (-8 * torch.rand(300_000, generator=g))  # every decade of the map and below
    bits = torch.arange(-(2**31), 2**31, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)  # all floats
    x = torch.cat([near, -near, code, -code, special, uniform, decades, bits])
    tie = torch.zeros(x.numel(), dtype=torch.bool)
    tie[: 2 * near.numel()] = True
    order = torch.randperm(x.numel(), generator=g)  # specials land in every lane of the vector encoder
    return x[order], tie[order]


@pytest.mark.skipif(find_compiler() is None, reason="no C compiler for the fused kernel")
@pytest.mark.parametrize("path", runnable_paths())
@pytest.mark.parametrize("signed", [True, False])
def test_kernel_encoder_is_exact(path, signed):
    if path != "c/scalar":
        assert fast_encoder(path)  # the table-driven encoder accepted both maps (else: the plain search)
    x, tie = _encoder_cases(signed)
    got = kernel_encode(x, signed, path)
    assert torch.equal(got, encode_normalized(x, signed))  # the torch reference (searchsorted on thresholds)
    code, _ = quant_tables(signed)
    plain = x.isfinite() & (x.abs() <= 1) & ~tie
    assert torch.equal(got[plain].long(), nearest_code(x[plain], code))  # nearest, ties to the lower code
    assert torch.equal(kernel_encode(x[:1000], signed, path), got[:1000])  # the scalar tail = the vector body
    assert torch.equal(kernel_encode(x[:63], signed, path), got[:63])
