"""Admission measured on a built executor at setup.

The model's parameters are already in host RAM when the strategy sees them, so ``admission`` counts every piece of
the run (masters, streamed copy, gradients, optimizer states) as the need and adds what the run already holds to the
available RAM as the have: a torch optimizer that allocates its states lazily at step 1 is refused here, before the
kernel's OOM killer would end the run there.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING

import psutil
import torch

from lightning_lazytrain.admission.count import admission_report
from lightning_lazytrain.engine.device import device_free_bytes
from lightning_lazytrain.tier_report import AdmissionReport

if TYPE_CHECKING:
    from lightning_lazytrain.engine.executor import StreamingExecutor
    from lightning_lazytrain.engine.weights.layout import ParamUnit


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
    params = [e.param for u in store.units for e in u.unique if e.packed is None]
    trainable = sum(p.numel() for p in params if p.requires_grad)
    frozen = sum(p.numel() for p in params if not p.requires_grad)
    frozen_4bit = sum(_packed_bytes(u) for u in store.units)
    shared = getattr(store, "shared", None)
    if shared is not None and optimizer is not None:
        state_bpp, state_held = optimizer_state_bytes_per_param(
            optimizer, sum(p.numel() for g in optimizer.param_groups for p in g["params"]))
    else:
        state_bpp, state_held = optimizer_state_bytes_per_param(optimizer, trainable)
    held = state_held
    if shared is None:
        held += store.held_bytes  # masters of the trainable prefix, the streamed copy (frozen weights in it)
    else:
        held += sum(u.master.numel() * u.master.element_size() for u in store.units
                    if u.master.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr())
    held += executor.sink.held_bytes()  # gradient buffers already allocated
    if shared is not None:
        held = held * ranks_per_host + shared.numel() * shared.element_size()
    gpu_kw = dict(gpu_have_bytes=0)
    if executor.device.type == "cuda":
        slots, resident = executor.pool.nbytes, executor.resident_device_bytes
        gpu_kw = dict(gpu_have_bytes=device_free_bytes(executor.device) + slots + resident, gpu_slot_bytes=slots,
                      gpu_resident_bytes=resident)
    cpu_kw = {}
    if executor.device.type != "cuda" and executor.pool is not None:
        # a run on the CPU accelerator: its "device" copies (weight slots, the resident parts and their gradients)
        # and the step's workspace are host RAM too
        cpu_kw = dict(cpu_device_bytes=executor.pool.nbytes + executor.resident_device_bytes,
                      cpu_workspace_bytes=_gradient_workspace_bytes(store.units, store.stream_dtype)
                      if optimizer is not None else 0)
    home = executor.path.gradient_home if executor.path is not None else "host"
    staging = getattr(executor.sink, "staging", None)
    staging_bytes = staging.held_bytes if staging is not None else 0
    on_host = home == "host" or (home == "device" and executor.device.type != "cuda")  # the CPU "device" is the host
    disk_kw = {}
    if staging is not None and staging.spill is not None:  # the file is reserved already: its bytes count as had
        disk_kw = dict(disk_have_bytes=shutil.disk_usage(staging.spill.root).free + staging.file_bytes)
    return admission_report(
        num_params=trainable, frozen_params=frozen, frozen_4bit_bytes=frozen_4bit, precision=precision,
        host_have_bytes=psutil.virtual_memory().available + held, optimizer_state_bytes_per_param=state_bpp,
        grad_accumulation=executor.updates is None, ranks_per_host=ranks_per_host, world_size=world_size,
        gradient_home="host" if on_host else home, gradient_staging_bytes=staging_bytes,
        pinned_slot_bytes=staging_bytes if on_host else 0,
        **cpu_kw, **disk_kw, **gpu_kw)


def _gradient_workspace_bytes(units: list[ParamUnit], stream_dtype: torch.dtype) -> int:
    """The largest unit's gradients as autograd returns them, alive together until the sink takes the unit: in the
    stream dtype, plus the fp32 sum the chunked head loss builds its weight gradient in when that dtype is narrower
    (``engine/loss/chunked.py``)."""
    itemsize = stream_dtype.itemsize
    per = itemsize + (4 if itemsize < 4 else 0)
    return per * max((u.trainable_numel for u in units), default=0)


def _packed_bytes(unit: ParamUnit) -> int:
    """Bytes of ``unit``'s flat buffer its 4-bit weights take: everything past its other parameters (the regions
    and their alignment), so the pieces add up to what the store holds."""
    if all(e.packed is None for e in unit.unique):
        return 0
    plain = sum(e.numel for e in unit.unique if e.packed is None)
    return (unit.numel - plain) * unit.stream.element_size()
