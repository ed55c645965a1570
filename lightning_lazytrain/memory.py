"""Admission control at setup: what the run will still allocate on the host, against what the machine has.

The model's parameters are already in host RAM when the strategy sees them, so the check counts every piece of the
run (masters, streamed copy, gradients, optimizer states) as the need and adds what the run already holds to the
available RAM as the have: a torch optimizer that allocates its states lazily at step 1 is refused here, before the
kernel's OOM killer would end the run there.
"""

from __future__ import annotations

import psutil
import torch

from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.schedule import AdmissionReport, admission_report


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def optimizer_state_bytes_per_param(optimizer: torch.optim.Optimizer | None, trainable: int) -> tuple[float, int]:
    """(bytes per parameter its states will take, bytes they already take)."""
    if optimizer is None or trainable == 0:
        return 0.0, 0
    held = sum(_tensor_bytes(state.values()) for state in optimizer.state.values())
    if hasattr(optimizer, "state_bytes"):
        return optimizer.state_bytes() / trainable, held
    if held:
        return held / trainable, held
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 8.0, 0
    if isinstance(optimizer, torch.optim.SGD) and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return 4.0, 0
    return 0.0, 0


def admission(executor: StreamingExecutor, optimizer: torch.optim.Optimizer | None, precision: str,
              ranks_per_host: int = 1, world_size: int = 1) -> AdmissionReport:
    """Several processes (``world_size > 1``): ``optimizer`` is this rank's shard optimizer, and the report is
    for the whole host: the shared streamed copy once, every local rank's private buffers ``ranks_per_host``
    times (they are all the same size, up to padding)."""
    store = executor.store
    params = [e.param for u in store.units for e in u.unique]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    shared = getattr(store, "shared", None)
    if shared is not None and optimizer is not None:
        state_bpp, state_held = optimizer_state_bytes_per_param(
            optimizer, sum(p.numel() for g in optimizer.param_groups for p in g["params"]))
    else:
        state_bpp, state_held = optimizer_state_bytes_per_param(optimizer, trainable)
    held = state_held
    for unit in store.units:
        if shared is None or unit.master.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr():
            held += unit.master.numel() * unit.master.element_size()
        if shared is None and unit.stream.data_ptr() != unit.master.data_ptr():
            held += unit.stream.numel() * unit.stream.element_size()
    held += executor.sink.held_bytes()  # gradient buffers already allocated
    if shared is not None:
        held = held * ranks_per_host + shared.numel() * shared.element_size()
    gpu_kw = {}
    if executor.device.type == "cuda":
        free = device_free_bytes(executor.device)
        slots = executor.pool.nbytes
        resident = executor.resident_device_bytes
        gpu_kw = dict(gpu_have_bytes=free + slots + resident, gpu_slot_bytes=slots, gpu_resident_bytes=resident)
    else:
        gpu_kw = dict(gpu_have_bytes=0)
    return admission_report(
        num_params=trainable, frozen_params=frozen, precision=precision,
        host_have_bytes=psutil.virtual_memory().available + held,
        optimizer_state_bytes_per_param=state_bpp,
        grad_accumulation=executor.updates is None,
        ranks_per_host=ranks_per_host, world_size=world_size,
        **gpu_kw,
    )
