"""Blockwise 8-bit codec in the bitsandbytes "dynamic map" format.

A state tensor is cut into blocks of ``block_size`` elements; each block stores its absolute maximum in fp32 and
every element as one byte, the index of the nearest value of a sorted 256-entry code book (the "dynamic map":
a decimal exponent plus a linear fraction) applied to ``x / absmax``. First moments use the signed map, second
moments (never negative) the unsigned one, as bitsandbytes' 8-bit optimizers do, so codes and absmax can be
handed to ``bitsandbytes.functional.dequantize_blockwise`` unchanged.

Encoding is exact nearest-value: the code of ``x`` is the number of decision thresholds (midpoints between
neighbouring map values) strictly below ``x``. The C kernel finds it from the float's octave and a line fitted to
each decade's evenly spaced thresholds, checked exact against these thresholds (``_adamw_codec.h``); the torch
reference below by ``searchsorted``; both use the same fp32 thresholds, hence the same codes.
(bitsandbytes' own CPU quantizer is not always nearest for tiny values; its codes decode identically here.)
"""

from __future__ import annotations

from functools import cache

import torch

__all__ = [
    "dynamic_map",
    "quant_tables",
    "quantize_blockwise",
    "dequantize_blockwise",
    "encode_normalized",
    "device_tables",
    "nearest_code",
]


@cache
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


def nearest_code(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Nearest code index by brute force (ties to the lower index): the specification the tests check against."""
    out = torch.empty(x.numel(), dtype=torch.int64)
    for s in range(0, x.numel(), 1 << 14):
        part = x[s : s + (1 << 14)]
        out[s : s + part.numel()] = (part.unsqueeze(1) - code.unsqueeze(0)).abs().argmin(dim=1)
    return out


@cache
def quant_tables(signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(code book fp32[256], decision thresholds fp32[256]) for the signed or unsigned map.

    ``thr[j]`` is the midpoint of codes j and j+1 (``thr[255] = +inf``); the nearest code of ``x`` is the number
    of thresholds strictly below ``x`` (ties to the lower code).
    """
    code = dynamic_map(signed)
    thr = torch.empty(256, dtype=torch.float32)
    thr[:255] = (code[:-1] + code[1:]) / 2
    thr[255] = float("inf")
    return code, thr


@cache
def device_tables(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_tables`` on ``device``, copied there once."""
    code, thr = quant_tables(signed)
    return code.to(device), thr.to(device)


def encode_normalized(x: torch.Tensor, signed: bool) -> torch.Tensor:
    """Codes (uint8) of values already divided by their block absmax (any device)."""
    _, thr = device_tables(signed, x.device)
    x = x.contiguous().float()
    # searchsorted(left) = count of thresholds < x; NaN -> 0 like the kernel (every comparison is false).
    c = torch.searchsorted(thr[:255], torch.nan_to_num(x, nan=-2.0))
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
    code, _ = device_tables(signed, codes.device)
    n = codes.numel()
    vals = code[codes.reshape(-1).long()]
    pad = (-n) % block_size
    if pad:
        vals = torch.cat([vals, vals.new_zeros(pad)])
    out = (vals.view(-1, block_size) * absmax[:, None]).reshape(-1)[:n]
    return out.view(codes.shape)
