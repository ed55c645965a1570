"""``HFExportCallback``: the trained model (and tokenizer) as an HF directory when fit ends; for a LoRA module, its
adapters in peft's format and, on request, the merged model."""

from __future__ import annotations

import lightning.pytorch as pl

from lightning_lazytrain.checkpoint.adapter_export import check_exportable, export_model
from lightning_lazytrain.checkpoint.hf_export import export_dtype, export_hf

__all__ = ["HFExportCallback", "export_hf"]


class HFExportCallback(pl.Callback):
    """Export ``pl_module.model`` (and the module's or datamodule's tokenizer) as an HF directory when fit ends.

    ``dtype``: of the written weights (``bfloat16`` by default, ``float32`` for the masters as they are, ``null``
    for whatever the model holds). A peft model writes its adapters to ``dirpath`` (``PeftModel.from_pretrained``)
    and, with ``merged_dirpath``, the merged model there (``AutoModelForCausalLM.from_pretrained``). The model is
    checked at fit start, before the first step, so a model that cannot be exported stops the run before it trains.
    """

    def __init__(self, dirpath: str, max_shard_size: str = "5GB", dtype: str | None = "bfloat16",
                 merged_dirpath: str | None = None) -> None:
        self.dirpath, self.max_shard_size, self.dtype = dirpath, max_shard_size, export_dtype(dtype)
        self.merged_dirpath = merged_dirpath

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_exportable(getattr(pl_module, "model", None))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        tok = getattr(pl_module, "tokenizer", None) or getattr(trainer.datamodule, "tokenizer", None)
        export_model(pl_module.model, self.dirpath, tokenizer=tok, dtype=self.dtype, merged_dir=self.merged_dirpath,
                     max_shard_size=self.max_shard_size)
