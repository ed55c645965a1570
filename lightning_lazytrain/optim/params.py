"""Which parameters an optimizer manages: the one definition every update path uses."""

from __future__ import annotations

import torch


def managed_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """``id()`` of every parameter in ``optimizer``'s groups (parameters are matched by identity, never by value)."""
    return {id(p) for group in optimizer.param_groups for p in group["params"]}
