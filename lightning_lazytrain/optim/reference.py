"""Pure-torch AdamW update, the reference the fused kernel is tested against and the path for CUDA tensors.

Same math, same operation order and the same 8-bit tables and stochastic-rounding hash as the C kernel, so the
two agree to fp32 rounding (codes can differ only where a value sits within an ulp of a decision threshold).
"""

from __future__ import annotations

import torch

from .quant import device_tables, encode_normalized

__all__ = ["mix32", "stochastic_round_bf16", "v_floor_coef", "reference_step"]

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor | int) -> torch.Tensor | int:
    """32-bit integer hash (int64 tensors or Python ints holding values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def stochastic_round_bf16(x: torch.Tensor, key: int) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 with probability proportional to the distance (unbiased), noise from (key, index).

    Deterministic: element i always gets noise hash(i * golden ^ key), whatever the device or thread count.
    """
    flat = x.reshape(-1).float()
    idx = torch.arange(flat.numel(), device=x.device, dtype=torch.int64)
    noise = mix32(((idx * 0x9E3779B9) & _M32) ^ (key & _M32)) & 0xFFFF
    bits = flat.view(torch.int32).to(torch.int64) & _M32
    rounded = ((bits + noise) >> 16) & 0xFFFF
    out = rounded.to(torch.int32).to(torch.int16).view(torch.bfloat16)
    # inf / NaN keep round-to-nearest-even (adding noise to a NaN payload could turn it into inf).
    special = ~torch.isfinite(flat)
    if bool(special.any()):
        out = torch.where(special, flat.to(torch.bfloat16), out)
    return out.view(x.shape)


def v_floor_coef(beta1: float, beta2: float, step: int) -> float:
    """c with v >= c * m^2 for every element after ``step`` exact Adam steps, whatever the gradients were.

    m = (1-b1) sum_j b1^j g_j and v = (1-b2) sum_j b2^j g_j^2 (j < step), so by Cauchy-Schwarz
    m^2 <= (1-b1)^2 S v / (1-b2) with S = sum_j (b1^2/b2)^j. 8-bit v decodes to 0 below 1.6e-7 of its block's
    absmax (gradients under 4e-4 of the block's largest) while m still has codes there (down to 2.8e-7 of its
    absmax), so without this floor such an element moves by lr * m / eps. With it |update| stays below
    lr * sqrt(1-b2^t) / ((1-b1^t) sqrt(c)), Adam's own bound (7.3 lr for 0.9/0.999, 1.8 lr at step 60).
    Shrunk by 1% so fp32 rounding of states that satisfy the bound never triggers it. 0: no bound (beta2 = 0).
    """
    if beta2 <= 0.0:
        return 0.0
    r = beta1 * beta1 / beta2
    try:
        s = float(step) if r == 1.0 else (1.0 - r**step) / (1.0 - r)
    except OverflowError:  # r > 1 (beta1^2 > beta2) over many steps: the bound goes to 0
        return 0.0
    return 0.99 * (1.0 - beta2) / ((1.0 - beta1) ** 2 * s)


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-t.numel()) % block
    flat = t.reshape(-1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


@torch.no_grad()
def reference_step(
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    copy: torch.Tensor | None,
    block: int,
    decay: float,
    beta1: float,
    beta2: float,
    neg_step: float,
    bc2_sqrt: float,
    eps: float,
    grad_scale: float,
    sr_key: int,
    v_floor: float = 0.0,
) -> None:
    """Update ``param`` and ``state`` in place (fp32 states ``exp_avg``/``exp_avg_sq`` or 8-bit ``*_codes``).

    ``v_floor``: 8-bit states only, v is raised to at least ``v_floor * m^2`` (:func:`v_floor_coef`).
    """
    n = param.numel()
    g = grad.reshape(-1).float()
    if grad_scale != 1.0:
        g = g * grad_scale
    eight_bit = "exp_avg_codes" in state
    if eight_bit:
        # cached per device: a fresh copy from pageable memory would make every update wait for its stream
        cm, cv = device_tables(True, param.device)[0], device_tables(False, param.device)[0]
        m = _blocks(cm[state["exp_avg_codes"].reshape(-1).long()], block) * state["exp_avg_absmax"][:, None]
        v = _blocks(cv[state["exp_avg_sq_codes"].reshape(-1).long()], block) * state["exp_avg_sq_absmax"][:, None]
        m, v = m.reshape(-1)[:n], v.reshape(-1)[:n]
    else:
        m, v = state["exp_avg"].reshape(-1), state["exp_avg_sq"].reshape(-1)
    p = param.reshape(-1).float()
    # Operation order as torch.optim.AdamW (single tensor): lerp, mul+addcmul, sqrt/bc2+eps, decay, addcdiv.
    m_new = torch.lerp(m, g, 1.0 - beta1)
    v_new = torch.addcmul(v * beta2, g, g, value=1.0 - beta2)
    if eight_bit and v_floor > 0.0:
        floor = m_new * m_new * v_floor
        v_new = torch.where(floor > v_new, floor, v_new)  # the kernel's compare: a NaN v stays NaN
    denom = v_new.sqrt() / bc2_sqrt + eps
    p_new = torch.addcdiv(p * decay, m_new, denom, value=neg_step)
    if param.dtype == torch.float32:
        param.view(-1).copy_(p_new)
        if copy is not None:
            copy.view(-1).copy_(p_new)
    else:
        rounded = stochastic_round_bf16(p_new, sr_key)
        param.view(-1).copy_(rounded)
        if copy is not None:
            copy.view(-1).copy_(rounded)
    if eight_bit:
        bm, bv = _blocks(m_new, block), _blocks(v_new, block)
        am, av = bm.abs().amax(dim=1), bv.amax(dim=1)
        im = torch.where(am > 0, 1.0 / am, torch.zeros_like(am))
        iv = torch.where(av > 0, 1.0 / av, torch.zeros_like(av))
        state["exp_avg_codes"].view(-1).copy_(encode_normalized(bm * im[:, None], True).reshape(-1)[:n])
        state["exp_avg_sq_codes"].view(-1).copy_(encode_normalized(bv * iv[:, None], False).reshape(-1)[:n])
        state["exp_avg_absmax"].copy_(am)
        state["exp_avg_sq_absmax"].copy_(av)
    else:
        state["exp_avg"].view(-1).copy_(m_new)
        state["exp_avg_sq"].view(-1).copy_(v_new)
