"""The application on top of the library: SFT data, the recipe LightningModule, metrics, export, the CLI.

Nothing in the library (strategy, precision, engine, schedule, optim, models, checkpoint) imports from here.
"""

from lightning_lazytrain.sft.data import SFTDataModule
from lightning_lazytrain.sft.module import CausalLMModule

__all__ = ["CausalLMModule", "SFTDataModule"]
