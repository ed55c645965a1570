"""What a benchmark row records beside its timings: host peak RSS from a sampling thread, the optimizer kernel path
that ran, the world size."""

from __future__ import annotations

import threading

import psutil
import torch


class HostPeakSampler:
    """Samples this process's RSS every ``interval_s`` on a daemon thread; ``peak_gib`` is the largest seen
    (a reading at batch ends alone misses the peaks of setup and of the update)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        proc = psutil.Process()
        while not self._stop.is_set():
            self.peak = max(self.peak, proc.memory_info().rss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> HostPeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def peak_gib(self) -> float:
        return self.peak / 2**30


def kernel_path(optimizer: object) -> str:
    """The update kernel an optimizer ran: the optimizer's own report where it has one (``kernel_path``), else what
    its settings select."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Lightning / DeepSpeed wrappers
    own = getattr(inner, "kernel_path", None)
    if own is not None:
        return own() if callable(own) else str(own)
    name = type(inner).__name__
    if name == "HybridAdamW":
        if not getattr(inner, "_use_kernel", False):
            return "HybridAdamW torch path"
        from lightning_lazytrain.optim import kernel

        return f"HybridAdamW C kernel (table encoder: {kernel.fast_encoder()})"
    if isinstance(inner, torch.optim.AdamW):
        group = inner.param_groups[0]
        device = group["params"][0].device.type if group["params"] else "?"
        if group.get("fused"):
            return f"torch AdamW fused ({device})"
        if group.get("foreach") or (group.get("foreach") is None and device == "cuda"):
            return f"torch AdamW foreach ({device})"
        return f"torch AdamW for-loop ({device})"
    return name


def trainer_facts(module) -> dict:
    """Kernel path and world size of the trainer that fitted ``module``."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return {"kernel_path": None, "world_size": None}
    optimizers = trainer.optimizers
    return {"kernel_path": kernel_path(optimizers[0]) if optimizers else None, "world_size": trainer.world_size}
