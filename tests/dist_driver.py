"""One multi-process run of the tiny model, started by tests/test_distributed.py (not collected by pytest).

Started once without LOCAL_RANK, Lightning's subprocess launcher re-runs this script for the other local ranks,
as it does for any user script; started by the test with LOCAL_RANK / NODE_RANK set, it is one "machine" of a
multi-node run. Every rank writes ``rank_<r>.json`` (losses, what its streamed copy maps, the admission pieces);
rank 0 also writes the final weights. With ``--configure-model-vocab`` the module builds its model in
``configure_model`` (one load per machine) and every rank also writes its buffers and what loading cost it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import lightning.pytorch as pl
import torch
from helpers import LMModule, batches, loader, tiny_model

from lightning_lazytrain import LazyTrainStrategy
from lightning_lazytrain.optim import HybridAdamW
from lightning_lazytrain.sft.module import CausalLMModule

HYBRID = "lightning_lazytrain.optim.HybridAdamW"
# the offline Qwen tokenizer's 151669 tokens need a vocabulary at least that large
SFT_SHAPE = dict(model_type="qwen2", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)


class HybridModule(LMModule):
    def configure_optimizers(self):
        return HybridAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, eight_bit_fraction=0.0)


class AnonPeak:
    """The peak growth of this process's anonymous memory (RssAnon: not the shared-memory copy it maps) from start()
    to stop(), sampled every 2 ms on a thread."""

    def __init__(self) -> None:
        self.base = self.peak = _rss_anon()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, _rss_anon())
            time.sleep(0.002)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return max(self.peak, _rss_anon()) - self.base


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class ConfiguredModule(HybridModule):
    """Builds its model in configure_model, inside the strategy's context (one load per machine)."""

    def __init__(self, vocab: int, peak: AnonPeak) -> None:
        super().__init__(None)
        self.vocab, self.peak = vocab, peak
        self.built_on: list[str] = []
        self.peak_growth = 0

    def configure_model(self) -> None:
        if self.model is None:
            self.model = tiny_model("qwen2", vocab_size=self.vocab)
            self.built_on = sorted({p.device.type for p in self.model.parameters()})

    def configure_optimizers(self):
        self.peak_growth = self.peak.stop()  # the store is built: the load is over, shards come next
        return super().configure_optimizers()


class SFTModule(CausalLMModule):
    """The recipe's module, which builds its model in configure_model; it records where that put the weights."""

    def __init__(self, vocab: int) -> None:  # save_hyperparameters reads these arguments: no AnonPeak (a thread)
        super().__init__(model_config={**SFT_SHAPE, "vocab_size": vocab}, optimizer=HYBRID, lr=1e-3,
                         optimizer_kwargs={"eight_bit_fraction": 0.0}, max_generate_samples=0)
        self.peak: AnonPeak | None = None
        self.built_on: list[str] = []
        self.peak_growth = 0

    def configure_model(self) -> None:
        super().configure_model()
        self.built_on = self.built_on or sorted({p.device.type for p in self.model.parameters()})

    def configure_optimizers(self):
        assert self.peak is not None
        self.peak_growth = self.peak.stop()
        return super().configure_optimizers()


class Probe(pl.Callback):
    """What the engine holds while it is alive (teardown releases it)."""

    def __init__(self) -> None:
        self.info: dict = {}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        store = strategy.executor.store
        shared_ptr = store.shared.untyped_storage().data_ptr()
        with open("/proc/self/maps") as f:
            maps = [line.split() for line in f if store.path in line]
        self.info = {
            "shm_path": store.path,
            "shm_inode": store.inode,
            "shm_bytes": store.shared_bytes,
            "maps": [(m[1], m[4]) for m in maps],  # permissions ('s' = MAP_SHARED) and inode of each mapping
            "params_view_shared": all(p.untyped_storage().data_ptr() == shared_ptr
                                      for p in pl_module.model.parameters()),
            "masters_view_shared": all(u.master.untyped_storage().data_ptr() == shared_ptr for u in store.units),
            "shard_numel": sum(u.master.numel() for u in store.units),
            "grad_shard_numel": sum(g.host.numel() for g in strategy.executor.sink.grads.values()),
            "host_pieces": strategy.admission_report.tiers["host"].pieces,
            "world_size": strategy.world_size,
            "local_world": strategy.processes.topology.local_world,
            "optimizer_threads": strategy.executor.updates.optimizer.num_threads,
        }


class DieAt(pl.Callback):
    """Rank ``rank`` leaves without a word at the start of step ``step``, as a process the OOM killer took; with
    ``hang``, it stops (SIGSTOP) instead: alive, its sockets open, never answering."""

    def __init__(self, rank: int, step: int, hang: bool) -> None:
        self.rank, self.step, self.hang = rank, step, hang

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            with open(os.path.join(trainer.default_root_dir, "died_at"), "w") as f:
                f.write(repr(time.time()))
            if self.hang:
                os.kill(os.getpid(), signal.SIGSTOP)
            os._exit(17)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--clip", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--ckpt-dir", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--force-distributed", action="store_true")
    parser.add_argument("--die-rank", type=int, default=None)
    parser.add_argument("--die-step", type=int, default=1)
    parser.add_argument("--hang", action="store_true", help="the --die-rank process stops instead of exiting")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--configure-model-vocab", type=int, default=None,
                        help="build the model in configure_model, with this vocabulary (its size sets the model's)")
    parser.add_argument("--sft", action="store_true", help="with --configure-model-vocab: the recipe's module")
    args = parser.parse_args()
    peak = AnonPeak()
    probe = Probe()
    callbacks: list[pl.Callback] = [probe]
    if args.ckpt_dir:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=1, save_top_k=-1))
    if args.die_rank is not None:
        callbacks.append(DieAt(args.die_rank, args.die_step, args.hang))
    strategy = LazyTrainStrategy(force_distributed=args.force_distributed, timeout_s=args.timeout_s)
    vocab = args.configure_model_vocab
    if vocab:
        module = SFTModule(vocab) if args.sft else ConfiguredModule(vocab, peak)
        module.peak = peak
    else:
        module = HybridModule(tiny_model("qwen2"))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, strategy=strategy,
        precision=args.precision, max_steps=args.steps, gradient_clip_val=args.clip, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        enable_checkpointing=bool(args.ckpt_dir), callbacks=callbacks, default_root_dir=args.out,
        use_distributed_sampler=False,
    )
    # Lightning's DistributedSampler always shuffles training data; for a reference run to compare with, rank r
    # takes batches r, r + N of 4 batches of 2 itself, so step k of every epoch sees batches 2k and 2k + 1.
    mine = batches(4, padded=args.sft)[trainer.global_rank :: trainer.world_size]  # the recipe reads the mask
    trainer.fit(module, loader(mine), ckpt_path=args.resume)
    rank = trainer.global_rank
    if rank == 0:
        torch.save({k: v.clone() for k, v in module.model.state_dict().items()}, os.path.join(args.out, "weights.pt"))
    if vocab:
        torch.save(dict(module.model.named_buffers()), os.path.join(args.out, f"buffers_{rank}.pt"))
        probe.info.update(built_on=module.built_on, peak_anon_growth=module.peak_growth)
    with open(os.path.join(args.out, f"rank_{rank}.json"), "w") as f:
        json.dump({"losses": getattr(module, "losses", []), **probe.info}, f)
    torch.distributed.barrier()  # rank 0 must not return before the others wrote their files


if __name__ == "__main__":
    main()
