"""The embedded default job: a short CPU fine-tune of a tiny Qwen-shaped model through ``strategy="lazytrain"``.

    python -m lightning_lazytrain.sft.demo [--steps 40]

The data is a learnable toy task (each sequence counts upwards modulo the vocabulary from a random start), so the
loss must fall well below its starting value; the script exits non-zero if it does not.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import lightning_lazytrain  # noqa: F401  (registers the strategy)


class CountingTask(torch.utils.data.Dataset):
    def __init__(self, size: int, seq: int, vocab: int) -> None:
        gen = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (size, 1), generator=gen)
        self.ids = (starts + torch.arange(seq)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class DemoModule(pl.LightningModule):
    def __init__(self, vocab: int = 256) -> None:
        super().__init__()
        config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2)
        self.model = AutoModelForCausalLM.from_config(config)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(float(loss.detach()))
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        from lightning_lazytrain.optim import HybridAdamW

        return HybridAdamW(self.parameters(), lr=3e-3, weight_decay=0.01)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    module = DemoModule()
    data = torch.utils.data.DataLoader(CountingTask(16 * args.steps, 32, 256), batch_size=16, shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true",
                         max_steps=args.steps, gradient_clip_val=1.0, logger=False, enable_checkpointing=False)
    trainer.fit(module, data)
    first, last = module.losses[0], sum(module.losses[-5:]) / 5
    print(f"lazytrain demo: loss {first:.3f} -> {last:.3f} over {args.steps} steps")
    if not last < 0.5 * first:
        raise SystemExit("the demo's loss did not fall: something is wrong with this install")


if __name__ == "__main__":
    main()
