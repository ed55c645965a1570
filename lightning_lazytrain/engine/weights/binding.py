"""Run a module's own forward with streamed tensors standing in for its parameters.

The module keeps its registered CPU master parameters (so ``state_dict`` and the optimizer are untouched); for the
duration of one call the parameter slots point at device tensors. Assigning ``_parameters`` directly skips the
``nn.Parameter`` type check, which is what lets plain (possibly grad-requiring leaf) tensors stand in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from lightning_lazytrain.engine.weights.layout import ParamUnit


@contextlib.contextmanager
def bound(unit: ParamUnit, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """Point every parameter of ``unit`` at ``tensors`` (one per ``unit.unique``), restoring the masters after."""
    for entry in unit.entries:
        entry.module._parameters[entry.name] = tensors[entry.uid]
    try:
        yield
    finally:
        for entry in unit.entries:
            entry.module._parameters[entry.name] = entry.param


def leaves_of(views: Sequence[torch.Tensor], unit: ParamUnit) -> list[torch.Tensor]:
    """Autograd leaves over ``views`` for the parameters that train, plain views for frozen ones; a 4-bit view
    stays as it is (a detached copy would lose its quant state)."""
    return [v if e.packed is not None else v.detach().requires_grad_(e.param.requires_grad)
            for v, e in zip(views, unit.unique)]
