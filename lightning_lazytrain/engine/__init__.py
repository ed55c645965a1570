"""The CPU-master layer-streaming executor."""

from lightning_lazytrain.engine.executor import DeviceTooSmallError, StreamingExecutor
from lightning_lazytrain.engine.plan import HOMES, Schedule

__all__ = ["DeviceTooSmallError", "HOMES", "Schedule", "StreamingExecutor"]
