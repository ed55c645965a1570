"""A layer run over its batch in row micro-batches: the same math, a working set that many times smaller.

A decoder layer treats the rows of its batch independently (attention within a row, norms and MLPs per token, MoE
routers per token with no capacity limit in the supported families), so running it on row slices and
concatenating the outputs gives the whole batch's output, and summing the slices' weight gradients gives the whole
batch's. The loss is still computed over the whole batch at the head: unlike ``accumulate_grad_batches``, the
user's batch, loss normalisation and optimizer step are unchanged. What shrinks is what a layer allocates while it
runs (its MLP intermediates, attention, and the graph of a layer re-run in the backward); the boundaries between
layers stay whole-batch.

The recorded call is sliced along with the hidden state: every tensor in its arguments whose first dimension is
the batch's rows (attention masks, position ids, rotary tables) is sliced, a first dimension of 1 broadcasts and is
kept, and anything else (caches, flags, 1-D cache positions) is passed as it is.
"""

from __future__ import annotations

from typing import Any

import torch


def row_slices(rows: int, micro_batches: int) -> list[slice]:
    """``micro_batches`` row ranges as even as they come, never an empty one (fewer when ``rows`` is smaller)."""
    count = max(1, min(micro_batches, rows))
    bounds = [rows * k // count for k in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _sliced(value: Any, rows: int, part: slice) -> Any:
    if isinstance(value, torch.Tensor):
        return value[part] if value.dim() >= 2 and value.shape[0] == rows else value
    if isinstance(value, tuple):
        return tuple(_sliced(v, rows, part) for v in value)
    if isinstance(value, list):
        return [_sliced(v, rows, part) for v in value]
    if isinstance(value, dict):
        return {k: _sliced(v, rows, part) for k, v in value.items()}
    shape = getattr(value, "shape", None)
    if isinstance(shape, (tuple, torch.Size)) and len(shape) >= 2 and shape[0] == rows:
        raise ValueError(f"layer micro-batches cannot slice the decoder layer's {type(value).__name__} argument "
                         f"(shape {tuple(shape)}, one entry per row): run with layer_micro_batches=1, or with "
                         "attn_implementation='sdpa' or 'eager', whose masks are tensors")
    return value


def split_call(args: tuple, kwargs: dict, rows: int, part: slice) -> tuple[tuple, dict]:
    """A layer call's arguments for the rows in ``part`` of a batch of ``rows``."""
    if part == slice(0, rows):
        return args, kwargs
    return _sliced(args, rows, part), _sliced(kwargs, rows, part)


class SummedGrads:
    """The weight gradients of one layer summed over its micro-batches, in their own dtype: the first
    micro-batch's tensors are kept and the others added into them in place, so one extra set is alive at a time
    (a broadcast gradient, stride 0, is replaced by the sum instead)."""

    def __init__(self) -> None:
        self.total: list[torch.Tensor | None] | None = None

    def add(self, grads: list[torch.Tensor | None]) -> None:
        if self.total is None:
            self.total = list(grads)
            return
        for i, g in enumerate(grads):
            if g is None:
                continue
            held = self.total[i]
            if held is None:
                self.total[i] = g
            elif 0 in held.stride() and held.numel() > 1:
                self.total[i] = held + g
            else:
                held.add_(g)
