"""Child process of ``test_engine_gradient_homes_rlimit.py``: trains a 87M-parameter Qwen2 shape on the CPU with one
gradient home under an address-space limit (``RLIMIT_AS``, 0: none) and prints its peak address space (VmPeak)."""

import resource
import sys

import lightning.pytorch as pl
import torch
from helpers import LMModule, batches, loader
from transformers import AutoModelForCausalLM, Qwen2Config

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.optim import HybridAdamW

CONFIG = dict(
    vocab_size=8192,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=3,
)


class Hybrid(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=1e-4)


def main(home: str, limit: int, spill_dir: str) -> None:
    torch.manual_seed(0)
    module = Hybrid(AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG)))
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=LazyTrainStrategy(gradient_home=home, spill_dir=spill_dir),
        precision="32-true",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        gradient_clip_val=1.0,
    )
    trainer.fit(module, loader([{k: v % 8192 for k, v in b.items()} for b in batches(2, batch=1, seq=16)]))
    with open("/proc/self/status") as status:
        peak = next(line for line in status if line.startswith("VmPeak")).split()[1]
    print(f"params {sum(p.numel() for p in module.parameters())} vmpeak {int(peak) * 1024}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
