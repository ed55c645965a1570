"""``HFExportCallback``: the trained model (and tokenizer) as an HF directory when fit ends."""

from __future__ import annotations

import lightning.pytorch as pl
from transformers import PreTrainedModel

from lightning_lazytrain.checkpoint.hf_export import export_dtype, export_hf


class HFExportCallback(pl.Callback):
    """Export ``pl_module.model`` (and the module's or datamodule's tokenizer) as an HF directory when fit ends.

    ``dtype``: of the written weights (``bfloat16`` by default, ``float32`` for the masters as they are, ``null``
    for whatever the model holds).
    """

    def __init__(self, dirpath: str, max_shard_size: str = "5GB", dtype: str | None = "bfloat16") -> None:
        self.dirpath, self.max_shard_size, self.dtype = dirpath, max_shard_size, export_dtype(dtype)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        model = getattr(pl_module, "model", None)
        if not isinstance(model, PreTrainedModel):
            raise TypeError("HFExportCallback needs the LightningModule's `model` to be a transformers PreTrainedModel")
        tok = getattr(pl_module, "tokenizer", None) or getattr(trainer.datamodule, "tokenizer", None)
        export_hf(model, self.dirpath, tokenizer=tok, max_shard_size=self.max_shard_size, dtype=self.dtype)
