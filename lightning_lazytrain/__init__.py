"""lightning-lazytrain: fine-tune LLMs too big for one GPU by streaming decoder layers from host memory.

Importing the package registers ``Trainer(strategy="lazytrain")``. The application's names (``CausalLMModule``,
``SFTDataModule``, ``DataError``) are resolved on first use, so importing the library does not import the
application.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_lazytrain.checkpoint import AtomicCheckpointIO, CorruptCheckpointError, find_last_good
from lightning_lazytrain.faults import ResourceError
from lightning_lazytrain.models import ModelNotFoundError, UnsupportedModelError, supported_architectures
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.precision import LazyTrainPrecision, UnsupportedPrecisionError
from lightning_lazytrain.strategy import LazyTrainStrategy

__version__ = "0.1.0"

if LazyTrainStrategy.strategy_name not in StrategyRegistry:
    LazyTrainStrategy.register_strategies(StrategyRegistry)

_APPLICATION = {
    "CausalLMModule": "lightning_lazytrain.sft.module",
    "SFTDataModule": "lightning_lazytrain.sft.data",
    "DataError": "lightning_lazytrain.sft.data.errors",
}


def __getattr__(name: str):
    if name in _APPLICATION:
        import importlib

        return getattr(importlib.import_module(_APPLICATION[name]), name)
    raise AttributeError(f"module 'lightning_lazytrain' has no attribute {name!r}")


__all__ = [
    "AtomicCheckpointIO",
    "CausalLMModule",
    "CorruptCheckpointError",
    "DataError",
    "HybridAdamW",
    "LazyTrainPrecision",
    "LazyTrainStrategy",
    "ModelNotFoundError",
    "ResourceError",
    "SFTDataModule",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "find_last_good",
    "supported_architectures",
]
