"""The random-number state a layer's forward started from, so its re-run in the backward draws the same dropout.

Like ``torch.utils.checkpoint(preserve_rng_state=True)``: the states of the CPU generator and of the executor
device's CUDA generator are taken before each layer whose forward will run again and set back before each re-run;
the backward as a whole runs under ``torch.random.fork_rng`` so the generators continue after it as after a plain
run's backward, which draws nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    cuda: torch.Tensor | None


def capture_rng(device: torch.device) -> RngState:
    return RngState(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def restore_rng(state: RngState, device: torch.device) -> None:
    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, device)


@contextlib.contextmanager
def rng_fork(device: torch.device) -> Iterator[None]:
    """On exit, the CPU generator and ``device``'s CUDA generator are back at their states on entry."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        yield
