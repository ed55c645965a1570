"""One small training run, built the same way in the test process and in a child process that gets killed.

Everything that an exact resume must carry is in it: HybridAdamW with 8-bit and fp32 states, a per-step LR
schedule, the global random stream (the training step draws from it), and a shuffled, resumable data order whose
epochs do not line up with the checkpoints.
"""

from __future__ import annotations

import copy
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from helpers import LMModule, tiny_model
from torch.utils.data import Dataset

import lightning_lazytrain  # noqa: F401  (registers the strategy name)
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.sft.data.sampler import ResumableDataLoader, ResumableRandomSampler

NUM_SAMPLES, BATCH, SEQ, MAX_STEPS = 10, 2, 16, 8  # 5 batches per epoch: steps 1-5, then 6-8 of epoch 1


class Samples(Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 512, (NUM_SAMPLES, SEQ), generator=gen)

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        labels = self.ids[i].clone()
        labels[: SEQ // 4] = -100
        return {"input_ids": self.ids[i], "labels": labels}


class NoisyHybridModule(LMModule):
    """The loss weight is drawn from the global RNG each step, so the run depends on that stream."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.draws: list[float] = []
        self.first_ids: list[int] = []

    def training_step(self, batch, batch_idx):
        weight = 1.0 + 0.5 * torch.rand(())
        self.draws.append(float(weight))
        self.first_ids.append(int(batch["input_ids"][0, 0]))
        return super().training_step(batch, batch_idx) * weight

    def configure_optimizers(self):
        opt = HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eight_bit_fraction=0.5,
                          min_8bit_numel=1024)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Crash(RuntimeError):
    pass


class CrashAt(pl.Callback):
    """Raise at the start of step ``step + 1``: checkpoints up to ``step`` are on disk, nothing after."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == self.step:
            raise Crash(f"simulated crash after step {self.step}")


def assert_same_tree(a, b, where="state"):
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def start_model() -> torch.nn.Module:
    return tiny_model("qwen2", seed=3)


def data_loader() -> ResumableDataLoader:
    data = Samples()
    return ResumableDataLoader(data, batch_size=BATCH, sampler=ResumableRandomSampler(data, seed=11))


def saver(dirpath: str) -> pl.callbacks.ModelCheckpoint:
    return pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_last=True)


def fit(model: torch.nn.Module, dirpath: str | None, ckpt_path: str | None = None, seed: int = 123,
        callbacks: tuple = ()) -> tuple[NoisyHybridModule, pl.Trainer]:
    module = NoisyHybridModule(copy.deepcopy(model))
    checkpointing = [saver(dirpath)] if dirpath else []
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="lazytrain", precision="32-true",
                         max_steps=MAX_STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(dirpath), callbacks=[*checkpointing, *callbacks],
                         num_sanity_val_steps=0)
    torch.manual_seed(seed)
    trainer.fit(module, data_loader(), ckpt_path=ckpt_path)
    return module, trainer


def kill_during_last_save(dirpath: str, step: int) -> None:
    """Train, and SIGKILL this process inside the save of ``last.ckpt`` for ``step``, just before its rename."""
    real_replace = os.replace
    last = os.path.join(dirpath, "last.ckpt")
    renames = []

    def replace(src, dst):
        if os.fspath(dst) == last:
            renames.append(dst)
            if len(renames) == step:
                os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst)

    os.replace = replace
    fit(start_model(), dirpath)


if __name__ == "__main__":
    kill_during_last_save(sys.argv[1], int(sys.argv[2]))
