"""lightning-lazytrain: fine-tune LLMs too big for one GPU by streaming decoder layers from host memory.

Importing the package registers ``Trainer(strategy="lazytrain")``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_lazytrain.data.errors import DataError
from lightning_lazytrain.faults import ResourceError
from lightning_lazytrain.models import UnsupportedModelError, supported_architectures
from lightning_lazytrain.precision import LazyTrainPrecision, UnsupportedPrecisionError
from lightning_lazytrain.strategy import LazyTrainStrategy, ModelNotFoundError

__version__ = "0.1.0"

if LazyTrainStrategy.strategy_name not in StrategyRegistry:
    LazyTrainStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "DataError",
    "LazyTrainPrecision",
    "LazyTrainStrategy",
    "ModelNotFoundError",
    "ResourceError",
    "UnsupportedModelError",
    "UnsupportedPrecisionError",
    "supported_architectures",
]
