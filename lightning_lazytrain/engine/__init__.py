"""The CPU-master layer-streaming executor."""

from lightning_lazytrain.engine.executor import DeviceTooSmallError, StreamingExecutor
from lightning_lazytrain.engine.plan import StackPlan

__all__ = ["DeviceTooSmallError", "StackPlan", "StreamingExecutor"]
