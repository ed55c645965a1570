"""Precision for the streamed executor: where masters live, what dtype streams, which context the step runs in.

``bf16-mixed``: fp32 masters on the CPU, a bf16 copy streamed, the step under bf16 autocast (as Lightning's
``MixedPrecision``). ``bf16-true``: bf16 masters streamed as they are, bf16 as the default dtype in the step (as
Lightning's ``HalfPrecision``). ``32-true``: fp32 everywhere. fp16 is refused: without a loss scaler that every
streamed layer would have to honour, fp16 gradients underflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from typing_extensions import override

_DTYPES = {
    "32-true": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "bf16-mixed": "bf16-mixed"}


class UnsupportedPrecisionError(ValueError):
    pass


def normalize_precision(precision: str | int) -> str:
    name = _ALIASES.get(precision, str(precision))
    if name not in _DTYPES:
        raise UnsupportedPrecisionError(
            f"lazytrain does not support precision={precision!r}; use 'bf16-mixed' (fp32 masters, bf16 compute),"
            " 'bf16-true' (bf16 masters) or '32-true'. fp16 needs a loss scaler that streamed layers do not run."
        )
    return name


class LazyTrainPrecision(Precision):
    def __init__(self, precision: str = "bf16-mixed") -> None:
        self.precision = normalize_precision(precision)
        self.device_type = "cpu"
        self._drain_gradients: Callable[[], None] | None = None
        self._engine_step: Callable[[float | None], object] | None = None
        self._clip_val: float | None = None

    def bind(self, device_type: str, drain_gradients: Callable[[], None],
             engine_step: Callable[[float | None], object] | None) -> None:
        """What the strategy hands over at setup: the device the step runs on, how to wait for the gradients the
        backward sent to the host, and, when the engine runs the update itself, the call that queues it (given the
        clip value; ``None``: the optimizer is stepped here as Lightning's precision plugins do)."""
        self.device_type = device_type
        self._drain_gradients = drain_gradients
        self._engine_step = engine_step

    def unbind(self) -> None:
        self._drain_gradients = self._engine_step = None

    @property
    def engine_steps(self) -> bool:
        """Whether the engine runs the optimizer update (no ``.grad`` on the host)."""
        return self._engine_step is not None

    @property
    def master_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision][0]

    @property
    def stream_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision][1]

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(torch.bfloat16)
        for param in module.parameters():
            if param.dtype != torch.float32 and param.is_floating_point():
                param.data = param.data.float()
        return module

    @override
    def convert_input(self, data: Any) -> Any:
        return data

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision == "bf16-mixed":
            with torch.autocast(self.device_type, dtype=torch.bfloat16):
                yield
        elif self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    @override
    def optimizer_step(self, optimizer, model, closure, **kwargs):
        if self._engine_step is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # The engine owns the update: run forward/backward, hooks and clipping, then queue per-unit updates.
        self._clip_val = None
        result = self._wrap_closure(model, optimizer, closure)
        self._engine_step(self._clip_val)
        # No parameter has a .grad in this mode, so optimizer.step() updates nothing; it is called so that torch's LR
        # schedulers (which wrap it to check the scheduler-after-optimizer order) see that the step happened.
        optimizer.step()
        return result

    @override
    def clip_grad_by_norm(self, optimizer, clip_val) -> None:
        if self._engine_step is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        # Gradients are not on the host as .grad; the norm comes from the device, the coefficient goes into the update.
        self._clip_val = float(clip_val)

    @override
    def clip_grad_by_value(self, optimizer, clip_val) -> None:
        if self._engine_step is not None:
            raise ValueError(
                "gradient_clip_algorithm='value' is not supported when lazytrain runs the update itself;"
                " use 'norm', or LazyTrainStrategy(overlap_updates=False)."
            )
        return super().clip_grad_by_value(optimizer, clip_val)

    @override
    def _wrap_closure(self, model, optimizer, closure):
        # Gradients land on the host asynchronously; they must be complete before hooks and clipping read them.
        result = closure()
        if self._drain_gradients is not None:
            self._drain_gradients()
        self._after_closure(model, optimizer)
        return result
