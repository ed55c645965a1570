"""What ``lazytrain plan`` reads off the config's ``trainer`` block (a plain dict, nothing instantiated): the
strategy's arguments, the process count, and the checkpoints the run keeps and where."""

from __future__ import annotations

import torch

from lightning_lazytrain.schedule.disk import checkpoints_kept
from lightning_lazytrain.sft.cli import ConfigError


def strategy_args(trainer: dict) -> dict:
    strategy = trainer.get("strategy")
    if isinstance(strategy, dict):
        name = str(strategy.get("class_path", ""))
        if not name.endswith("LazyTrainStrategy"):
            raise ConfigError(f"trainer.strategy is {name}; lazytrain plan plans the lazytrain strategy only")
        return dict(strategy.get("init_args") or {})
    if strategy not in ("lazytrain", None):
        raise ConfigError(f"trainer.strategy={strategy!r}; lazytrain plan plans the lazytrain strategy only")
    return {}


def devices(trainer: dict) -> int:
    devices = trainer.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        return len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, int) and devices > 0:
        return devices
    return max(1, torch.cuda.device_count())  # "auto" / -1: what Lightning would take here


def model_checkpoints(trainer: dict) -> list[dict]:
    return [
        c.get("init_args") or {}
        for c in trainer.get("callbacks") or []
        if isinstance(c, dict) and str(c.get("class_path", "")).endswith("ModelCheckpoint")
    ]


def kept_checkpoints(trainer: dict) -> int:
    """Checkpoints on disk: each ModelCheckpoint's (its save_top_k, -1 counted as 1, and a last.ckpt copy), else
    Lightning's default callback (one) unless checkpointing is off."""
    callbacks = model_checkpoints(trainer)
    if callbacks:
        return sum(checkpoints_kept(int(args.get("save_top_k", 1)), args.get("save_last")) for args in callbacks)
    return 0 if trainer.get("enable_checkpointing") is False else 1


def weights_only(trainer: dict) -> bool:
    """Whether the run's checkpoints hold the masters only: every ModelCheckpoint has save_weights_only (Lightning's
    default callback saves full state; mixed callbacks are all sized as full state, the larger)."""
    callbacks = model_checkpoints(trainer)
    return bool(callbacks) and all(args.get("save_weights_only") is True for args in callbacks)


def checkpoint_dir(trainer: dict) -> str:
    """Where the run's checkpoints go: a ModelCheckpoint's dirpath, else the logger's save_dir, else the root dir."""
    for args in model_checkpoints(trainer):
        if args.get("dirpath"):
            return str(args["dirpath"])
    logger = trainer.get("logger")
    if isinstance(logger, dict) and (logger.get("init_args") or {}).get("save_dir"):
        return str(logger["init_args"]["save_dir"])
    return str(trainer.get("default_root_dir") or ".")
