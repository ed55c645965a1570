"""Gradient clipping split into the pieces a streaming engine needs.

The engine takes each layer's squared gradient norm while the gradient is still on the GPU
(:func:`grad_norm_sq`, one foreach kernel per call), adds the per-layer scalars on the device, turns the total into
a coefficient (:func:`clip_coefficient`) and hands that to ``HybridAdamW.step_params(..., clip_coef=...)``, which
folds it into the update: the gradients are never rescaled in a separate pass. :class:`NonFiniteGuard` decides
whether a step with a non-finite norm is skipped, and aborts after three in a row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["grad_norm_sq", "clip_coefficient", "NonFiniteGuard"]


def grad_norm_sq(tensors: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """Sum of squared L2 norms of ``tensors`` (``None`` skipped) as an fp32 0-dim tensor on their device.

    Per-tensor norms come from ``torch._foreach_norm`` (one fused launch per dtype/device group); they are
    computed in fp32 for bf16/fp16 inputs so the sum neither overflows nor loses the small layers. No host sync.
    """
    ts = [t for t in tensors if t is not None]
    if not ts:
        return torch.zeros((), dtype=torch.float32)
    device = ts[0].device
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in ts:
        groups.setdefault((t.device, t.dtype), []).append(t)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_dev, dtype), group in groups.items():
        if dtype in (torch.float32, torch.float64):
            norms = torch._foreach_norm(group, 2)
        else:
            norms = torch._foreach_norm(group, 2, dtype=torch.float32)
        sq = torch.stack([n.float() for n in norms]).square().sum()
        total = total + sq.to(device)
    return total


def clip_coefficient(total_norm_sq: torch.Tensor | float, max_norm: float, eps: float = 1e-6) -> float:
    """Factor to multiply gradients by so their global norm is at most ``max_norm`` (1.0 when already below).

    Same formula as ``torch.nn.utils.clip_grad_norm_``: ``min(1, max_norm / (norm + eps))``. Returns ``nan`` for
    a non-finite norm so callers cannot miss it (see :class:`NonFiniteGuard`). One host sync if given a tensor.
    """
    norm_sq = float(total_norm_sq)
    if not math.isfinite(norm_sq):
        return float("nan")
    norm = torch.tensor(norm_sq, dtype=torch.float32).sqrt()
    coef = max_norm / (norm + eps)
    return float(coef.clamp(max=1.0))


class NonFiniteGuard:
    """Skip optimizer steps whose gradient norm is inf/NaN; raise after ``max_consecutive`` in a row.

    ``check(norm_sq, step)`` returns True when the step may proceed. A finite norm resets the streak.
    ``skipped`` counts all skipped steps (log it). The state is tiny and part of checkpoints via
    ``state_dict``/``load_state_dict`` so a resume continues the streak.
    """

    def __init__(self, max_consecutive: int = 3) -> None:
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.skipped = 0

    def check(self, total_norm_sq: torch.Tensor | float, step: int) -> bool:
        if math.isfinite(float(total_norm_sq)):
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped += 1
        if self.consecutive >= self.max_consecutive:
            raise RuntimeError(
                f"non-finite gradient norm ({float(total_norm_sq)}) at step {step}: {self.consecutive} steps in a "
                f"row (steps {step - self.consecutive + 1}..{step}) were skipped; training is diverging - lower the "
                "learning rate, check the data or use a loss scale"
            )
        return False

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped": self.skipped, "max_consecutive": self.max_consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = state["consecutive"]
        self.skipped = state["skipped"]
        self.max_consecutive = state["max_consecutive"]
