"""Hybrid 8-bit AdamW for CPU-resident masters, and fast gradient clipping helpers."""

from .clipping import NonFiniteGuard, clip_coefficient, grad_norm_sq
from .hybrid_adamw import HybridAdamW
from .kernel import KernelUnavailable, kernel_available, kernel_path
from .params import managed_ids

__all__ = [
    "HybridAdamW",
    "NonFiniteGuard",
    "clip_coefficient",
    "grad_norm_sq",
    "KernelUnavailable",
    "kernel_available",
    "kernel_path",
    "managed_ids",
]
