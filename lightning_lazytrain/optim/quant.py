"""Blockwise 8-bit codec in the bitsandbytes "dynamic map" format.

A state tensor is cut into blocks of ``block_size`` elements; each block stores its absolute maximum in fp32 and
every element as one byte, the index of the nearest value of a sorted 256-entry code book (the "dynamic map":
a decimal exponent plus a linear fraction) applied to ``x / absmax``. First moments use the signed map, second
moments (never negative) the unsigned one, as bitsandbytes' 8-bit optimizers do, so codes and absmax can be
handed to ``bitsandbytes.functional.dequantize_blockwise`` unchanged.

Encoding uses a lookup table instead of a search: the top 16 bits of the fp32 pattern of ``x`` (sign, exponent,
7 mantissa bits) select a bucket; every bucket contains at most one decision threshold of the map (checked when
the table is built), so ``code = lut[bits >> 16] + (x > threshold[lut[bits >> 16]])`` is the exact nearest code.
The C kernel and the torch reference below use the same tables, hence the same codes.
"""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = [
    "dynamic_map",
    "quant_tables",
    "quantize_blockwise",
    "dequantize_blockwise",
    "encode_normalized",
]


@lru_cache(maxsize=None)
def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic map (7 exponent bits), bit-identical to bitsandbytes'."""
    values: list[float] = []
    for i in range(7):
        # Decade 10^(i-6): the signed map spends one bit on the sign, so each decade has half as many steps.
        n_edges = 2**i + 1 if signed else 2 ** (i + 1) + 1
        edges = torch.linspace(0.1, 1, n_edges, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (i - 6)
        values += (scale * mids).tolist()
        if signed:
            values += (-scale * mids).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    values.sort()
    return torch.tensor(values, dtype=torch.float32)


def _nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Nearest code index by brute force (ties to the lower index); used only to build and check tables."""
    out = torch.empty(x.numel(), dtype=torch.int64)
    for s in range(0, x.numel(), 1 << 14):
        part = x[s : s + (1 << 14)]
        out[s : s + part.numel()] = (part.unsqueeze(1) - code.unsqueeze(0)).abs().argmin(dim=1)
    return out


@lru_cache(maxsize=None)
def quant_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(code book fp32[256], lut uint8[65536], threshold fp32[256]) for the signed or unsigned map."""
    code = dynamic_map(signed)
    # Decision thresholds between neighbours; duplicates (the unsigned map's padding zeros) give equal values.
    thr = torch.empty(256, dtype=torch.float32)
    thr[:255] = (code[:-1] + code[1:]) / 2
    thr[255] = float("inf")
    prefixes = torch.arange(65536, dtype=torch.int64)
    lo_bits = (prefixes << 16).to(torch.int64)
    hi_bits = lo_bits | 0xFFFF
    # int64 -> int32 keeps the low 32 bits, the fp32 pattern we want.
    lo = lo_bits.to(torch.int32).view(torch.float32).clone()
    hi = hi_bits.to(torch.int32).view(torch.float32).clone()
    # Outside [-1, 1] clamp to the end codes (normalized values only get there by rounding); NaN buckets follow
    # their sign like infinities do.
    sign = torch.where(prefixes >= 32768, -1.0, 1.0)
    lo = torch.where(lo.isnan(), sign, lo).clamp(-1.0, 1.0)
    hi = torch.where(hi.isnan(), sign, hi).clamp(-1.0, 1.0)
    n_lo, n_hi = _nearest(lo, code), _nearest(hi, code)
    first = torch.minimum(n_lo, n_hi)
    # The lookup is exact only if no bucket straddles two thresholds (the map has no duplicate values).
    if bool(((n_lo - n_hi).abs() > 1).any()):
        raise AssertionError("dynamic map too fine for a 16-bit lookup table")
    lut = first.to(torch.uint8)
    return code, lut.contiguous(), thr


def encode_normalized(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Codes (uint8) of values already divided by their block absmax, via the lookup table (any device)."""
    code, lut, thr = (t.to(x.device) for t in quant_tables(signed))
    x = x.contiguous().float()
    prefix = (x.view(torch.int32) >> 16) & 0xFFFF
    c = lut[prefix.long()].long()
    c = c + (x > thr[c]).long()
    return c.to(torch.uint8)


def _pad_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block_size
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block_size)


def quantize_blockwise(
    x: torch.Tensor, signed: bool = True, block_size: int = 4096
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to (codes uint8 shaped like x, absmax fp32[n_blocks]) in the bitsandbytes layout."""
    blocks = _pad_blocks(x, block_size)
    absmax = blocks.abs().amax(dim=1)
    # Multiply by the reciprocal (as the fused kernel does) so both produce identical codes; empty blocks -> 0.
    inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
    codes = encode_normalized(blocks * inv[:, None], signed).reshape(-1)[: x.numel()]
    return codes.view(x.shape), absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, signed: bool = True, block_size: int = 4096
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise`: fp32 tensor shaped like ``codes``."""
    code = dynamic_map(signed).to(codes.device)
    n = codes.numel()
    vals = code[codes.reshape(-1).long()]
    pad = (-n) % block_size
    if pad:
        vals = torch.cat([vals, vals.new_zeros(pad)])
    out = (vals.view(-1, block_size) * absmax[:, None]).reshape(-1)[:n]
    return out.view(codes.shape)
