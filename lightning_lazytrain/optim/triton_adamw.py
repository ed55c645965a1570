"""The AdamW update of ``reference.reference_step`` as one Triton kernel per parameter, for CUDA tensors.

The torch reference runs about twenty kernels per parameter (decode through int64 indices, a searchsorted per
state, the stochastic-rounding hash in int64) and was measured at 0.40 s of GPU time per step for the device share
of a 3B model on an H100 (``benchmarks/results/archive/ab_3b_resident_4af4b1c_h100.json``), work that then competes
with the next forward. Here one program reads a block of gradients, codes, absmax, masters, and writes them back
once: the update is bounded by memory bandwidth (about 16 bytes a parameter with 8-bit states).

Operation by operation the CPU kernel's arithmetic (``_adamw_kernel.c``): fused multiply-adds exactly where it has
them (``tl.fma``) and nowhere else (``enable_fp_fusion=False``), IEEE division and square root (``div_rn``,
``sqrt_rn``), scalars rounded to fp32 the same way, the same code tables and hash. A version that let the compiler
fuse freely differed from it by an ulp here and there, and Adam's first steps (the update is about the sign of
the gradient) amplified that to 3e-4 of the weights after 3 steps of a tiny bf16-mixed model.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import device_tables
from .state_layout import fused_layout

__all__ = ["fused_step", "supports"]

_FP32_BLOCK = 1024  # elements per program for fp32 states (no block structure to follow)


def supports(param: torch.Tensor, state: dict, block: int) -> bool:
    """Whether ``fused_step`` handles this update (else the torch reference does): a contiguous CUDA tensor in a
    layout the kernel knows (``state_layout.fused_layout``)."""
    return param.device.type == "cuda" and param.is_contiguous() and fused_layout(param.dtype, state, block)


@triton.jit
def _count_below(thr_ptr, x, BLOCK: tl.constexpr):
    """How many of the 256 sorted thresholds (``thr[255] = +inf``) are strictly below ``x``: the nearest code.
    A NaN compares false everywhere, so it gets code 0 as in the reference."""
    pos = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.static_range(8):
        cand = pos + (128 >> i)
        pos = tl.where(tl.load(thr_ptr + cand - 1) < x, cand, pos)
    return pos


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _store_weights(p_ptr, copy_ptr, offs, mask, p_new, sr_key, P_BF16: tl.constexpr, HAS_COPY: tl.constexpr):
    """The new master (bf16: stochastically rounded with the reference's hash) and its bf16 stream copy."""
    if P_BF16:
        key = (sr_key.to(tl.int64) + 0x80000000) & 0xFFFFFFFF
        noise = _mix32(((offs * 0x9E3779B9) & 0xFFFFFFFF) ^ key) & 0xFFFF
        bits = p_new.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        rounded = (((bits + noise) >> 16) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        finite = (p_new == p_new) & (tl.abs(p_new) != float("inf"))
        out = tl.where(finite, rounded, p_new.to(tl.bfloat16, fp_downcast_rounding="rtne"))
        tl.store(p_ptr + offs, out, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offs, out, mask=mask)
    else:
        tl.store(p_ptr + offs, p_new, mask=mask)
        if HAS_COPY:
            tl.store(copy_ptr + offs, p_new.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit(do_not_specialize=["sr_key"])
def _adamw_8bit(p_ptr, g_ptr, copy_ptr, mc_ptr, vc_ptr, ma_ptr, va_ptr, cm_ptr, cv_ptr, tm_ptr, tv_ptr, n,
                decay, w1, beta2, w2, neg_step, bc2_sqrt, eps, grad_scale, v_floor, sr_key,
                BLOCK: tl.constexpr, P_BF16: tl.constexpr, HAS_COPY: tl.constexpr, FLOOR: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    mcode = tl.load(mc_ptr + offs, mask=mask, other=0).to(tl.int32)
    vcode = tl.load(vc_ptr + offs, mask=mask, other=0).to(tl.int32)
    m = tl.load(cm_ptr + mcode) * tl.load(ma_ptr + pid)
    v = tl.load(cv_ptr + vcode) * tl.load(va_ptr + pid)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m_new = tl.fma(w1, g - m, m)  # torch.lerp with a weight below 0.5, as the C kernel has it
    v_new = tl.fma(w2 * g, g, v * beta2)  # torch.addcmul
    if FLOOR:
        floor = m_new * m_new * v_floor
        v_new = tl.where(floor > v_new, floor, v_new)
    denom = tl.div_rn(tl.sqrt_rn(v_new), bc2_sqrt) + eps
    p_new = p * decay + tl.div_rn(neg_step * m_new, denom)  # torch.addcdiv
    _store_weights(p_ptr, copy_ptr, offs, mask, p_new, sr_key, P_BF16, HAS_COPY)
    # the block's new absmax and codes; lanes past the end are zero, as the reference's padding is
    m_new = tl.where(mask, m_new, 0.0)
    v_new = tl.where(mask, v_new, 0.0)
    am = tl.max(tl.abs(m_new), axis=0)
    av = tl.max(v_new, axis=0)
    im = tl.where(am > 0, tl.div_rn(1.0, am), 0.0)
    iv = tl.where(av > 0, tl.div_rn(1.0, av), 0.0)
    tl.store(mc_ptr + offs, _count_below(tm_ptr, m_new * im, BLOCK).to(tl.uint8), mask=mask)
    tl.store(vc_ptr + offs, _count_below(tv_ptr, v_new * iv, BLOCK).to(tl.uint8), mask=mask)
    tl.store(ma_ptr + pid, am)
    tl.store(va_ptr + pid, av)


@triton.jit(do_not_specialize=["sr_key"])
def _adamw_fp32(p_ptr, g_ptr, copy_ptr, m_ptr, v_ptr, n, decay, w1, beta2, w2, neg_step, bc2_sqrt, eps, grad_scale,
                sr_key, BLOCK: tl.constexpr, P_BF16: tl.constexpr, HAS_COPY: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * grad_scale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m_new = tl.fma(w1, g - m, m)
    v_new = tl.fma(w2 * g, g, v * beta2)
    denom = tl.div_rn(tl.sqrt_rn(v_new), bc2_sqrt) + eps
    p_new = p * decay + tl.div_rn(neg_step * m_new, denom)
    _store_weights(p_ptr, copy_ptr, offs, mask, p_new, sr_key, P_BF16, HAS_COPY)
    tl.store(m_ptr + offs, m_new, mask=mask)
    tl.store(v_ptr + offs, v_new, mask=mask)


@torch.no_grad()
def fused_step(*, param: torch.Tensor, grad: torch.Tensor, state: dict, copy: torch.Tensor | None, block: int,
               decay: float, beta1: float, beta2: float, neg_step: float, bc2_sqrt: float, eps: float,
               grad_scale: float, sr_key: int, v_floor: float = 0.0) -> None:
    """``reference_step`` with the same arguments, as one kernel launch (``supports`` must hold)."""
    n = param.numel()
    if n == 0:
        return
    grad = grad.contiguous()
    # the reference's scalars are Python doubles that torch rounds to fp32: 1 - beta is formed before that rounding
    common = dict(decay=decay, w1=1.0 - beta1, beta2=beta2, w2=1.0 - beta2, neg_step=neg_step, bc2_sqrt=bc2_sqrt,
                  eps=eps, grad_scale=grad_scale)
    flags = dict(P_BF16=param.dtype == torch.bfloat16, HAS_COPY=copy is not None)
    out_copy = copy if copy is not None else param
    # a key changes every step: passed as one int32 type (shifted into its range) and never specialized on, else
    # each new key could compile a new variant of the kernel in the middle of training
    key = (sr_key & 0xFFFFFFFF) - 0x80000000
    if "exp_avg_codes" in state:
        cm, tm = device_tables(True, param.device)
        cv, tv = device_tables(False, param.device)
        _adamw_8bit[(triton.cdiv(n, block),)](
            param, grad, out_copy, state["exp_avg_codes"], state["exp_avg_sq_codes"], state["exp_avg_absmax"],
            state["exp_avg_sq_absmax"], cm, cv, tm, tv, n, v_floor=v_floor, sr_key=key, BLOCK=block,
            FLOOR=v_floor > 0.0, num_warps=8, enable_fp_fusion=False, **common, **flags)
    else:
        _adamw_fp32[(triton.cdiv(n, _FP32_BLOCK),)](
            param, grad, out_copy, state["exp_avg"], state["exp_avg_sq"], n, sr_key=key, BLOCK=_FP32_BLOCK,
            num_warps=4, enable_fp_fusion=False, **common, **flags)
