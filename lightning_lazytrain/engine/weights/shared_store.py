"""The host store of a multi-process run: one streamed copy per machine in shared memory, masters sharded.

Every unit's flat buffer is padded to a multiple of the world size and split into equal shards; global rank ``r``
owns shard ``r`` of every unit (its master weights, gradients and optimizer states). The streamed copy of all
units lives in one file under ``/dev/shm`` (``LAZYTRAIN_SHM_DIR``), created and filled by local rank 0 and mapped
``MAP_SHARED`` by every local rank, so a machine holds it once however many GPUs it has. The file is unlinked as
soon as every local rank has mapped it: the memory lives as long as the mappings, and a crash leaves nothing behind.

After a rank updates its shard it writes it into its machine's copy; ``publish`` then fetches the shards of the
same unit that ranks on other machines own (gloo all-gather over ``cross_group``) and waits for the machine's other
ranks (``local_group`` barrier), after which the machine's copy of the unit is whole. When masters have the stream
dtype (``32-true``, ``bf16-true``) a rank's master shard *is* its slice of the shared copy: no second buffer.
The module's parameters view the shared copy, so ``state_dict()`` reads the current weights in the stream dtype.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from lightning_lazytrain.engine.weights.layout import ParamEntry, ParamUnit, collect_entries
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.engine.weights.topology import Topology, all_gather_flat

log = logging.getLogger(__name__)
_ALIGN = 256  # elements: every unit starts on a fresh cache line / DMA-friendly boundary in the shared file


@dataclass(frozen=True)
class ShardLayout:
    numel: int
    padded: int
    start: int
    stop: int
    file_offset: int

    @property
    def shard(self) -> int:
        return self.stop - self.start

    def overlap(self, offset: int, numel: int) -> tuple[int, int] | None:
        """The part of unit elements ``[offset, offset + numel)`` inside this rank's shard, as (lo, hi) in the
        shard's own coordinates (``lo + start`` in the unit's); None when they do not meet."""
        lo, hi = max(self.start, offset), min(self.stop, offset + numel)
        return (lo - self.start, hi - self.start) if lo < hi else None


class SharedParamStore(HostParamStore):
    streams_from_masters = False  # the streamed copy is the machine's shared file, written by ``publish``

    def __init__(
        self,
        groups: list[tuple[str, list[nn.Module]]],
        master_dtype: torch.dtype,
        stream_dtype: torch.dtype,
        pin: bool,
        topology: Topology,
        shm_dir: str | None = None,
    ) -> None:
        self.topology, self.shm_dir = topology, shm_dir or os.environ.get("LAZYTRAIN_SHM_DIR")
        super().__init__(groups, master_dtype, stream_dtype, pin)

    def _build_units(self, groups: list[tuple[str, list[nn.Module]]]) -> list[ParamUnit]:
        topology = self.topology
        flat = [collect_entries(mods, self.stream_dtype.itemsize) for _, mods in groups]
        packed = next((e for _, unique, _ in flat for e in unique if e.packed is not None), None)
        if packed is not None:
            raise ValueError(f"{type(packed.module).__name__}.{packed.name} is a bitsandbytes 4-bit weight: a 4-bit"
                             " (QLoRA) base streams in one process only so far; run on one GPU (devices=1), or"
                             " use a bf16 base (lora.quantize: none) across several")
        # ranks of this machine that built the model on the meta device (node_load.py) take local rank 0's weights
        self.node_empty = _check_same_weights([label for label, _ in groups], [u for _, u, _ in flat], topology)
        self.layouts: list[ShardLayout] = []
        end = 0
        for _, _, total in flat:
            shard = -(-total // topology.world_size)
            start = topology.rank * shard
            self.layouts.append(ShardLayout(total, shard * topology.world_size, start, start + shard, end))
            end += -(-shard * topology.world_size // _ALIGN) * _ALIGN
        self.shared = self._open_shared(end, [u for _, u, _ in flat], self.shm_dir)
        if self.pinned.enabled and not self.pinned.register(self.shared):
            log.warning("lazytrain: could not pin the shared streamed copy; weight copies to the GPU will be slower")
        staging = self._open_staging() if self.node_empty and not self.masters_are_shared else None
        units = [self._shared_unit(i, label, entries, unique, staging)
                 for i, ((label, _), (entries, unique, _)) in enumerate(zip(groups, flat))]
        topology.local_barrier()  # every rank copied its master shards out of the staging file before it goes
        return units

    @property
    def shared_bytes(self) -> int:
        return self.shared.numel() * self.shared.element_size()

    @property
    def masters_are_shared(self) -> bool:
        return self.master_dtype == self.stream_dtype

    def padded_view(self, unit: ParamUnit) -> torch.Tensor:
        lay = self.layouts[unit.index]
        return self.shared[lay.file_offset : lay.file_offset + lay.padded]

    def _open_shared(self, numel: int, units: list[list[ParamEntry]], shm_dir: str | None) -> torch.Tensor:
        topo = self.topology
        self.path = os.path.join(shm_dir or "/dev/shm", f"lazytrain-{topo.token}-node{topo.node_rank}.bin")
        nbytes = numel * self.stream_dtype.itemsize
        shared = None
        if topo.local_rank == 0:
            _reserve(self.path, nbytes)
            shared = torch.from_file(self.path, shared=True, size=numel, dtype=self.stream_dtype)
            for lay, unique in zip(self.layouts, units):
                view = shared[lay.file_offset : lay.file_offset + lay.padded]
                view[lay.numel :].zero_()
                for e in unique:
                    view[e.offset : e.offset + e.numel].copy_(e.param.data.reshape(-1))
        topo.local_barrier()
        if shared is None:
            shared = torch.from_file(self.path, shared=True, size=numel, dtype=self.stream_dtype)
        self.inode = os.stat(self.path).st_ino
        topo.local_barrier()
        if topo.local_rank == 0:
            os.unlink(self.path)
        return shared

    def _shared_unit(self, index: int, label: str, entries: list[ParamEntry], unique: list[ParamEntry],
                     staging: torch.Tensor | None) -> ParamUnit:
        lay = self.layouts[index]
        padded = self.shared[lay.file_offset : lay.file_offset + lay.padded]
        if self.masters_are_shared:
            master = padded[lay.start : lay.stop]
        elif staging is not None:
            master = self._staged_master(lay, unique, staging)
        else:
            master = torch.zeros(lay.shard, dtype=self.master_dtype)
            for e in unique:
                part = lay.overlap(e.offset, e.numel)
                if part is not None:
                    lo, hi = part
                    skip = lay.start - e.offset  # where the shard starts in the parameter's own elements
                    master[lo:hi].copy_(e.param.data.reshape(-1)[lo + skip : hi + skip])
        stream = padded[: lay.numel]
        _bind(entries, unique, stream)
        return ParamUnit(index, label, entries, lay.numel, master, stream, unique=unique)

    def _open_staging(self) -> torch.Tensor:
        """A shared file of one unit in the master dtype: local rank 0 writes each unit's full-precision weights
        there in turn and every rank copies its master shard out (the streamed copy may be bf16, too coarse)."""
        topo = self.topology
        path = f"{self.path[: -len('.bin')]}-masters.bin"
        numel = max(lay.padded for lay in self.layouts)
        if topo.local_rank == 0:
            _reserve(path, numel * self.master_dtype.itemsize)
        topo.local_barrier()
        staging = torch.from_file(path, shared=True, size=numel, dtype=self.master_dtype)
        topo.local_barrier()
        if topo.local_rank == 0:
            os.unlink(path)
        return staging

    def _staged_master(self, lay: ShardLayout, unique: list[ParamEntry], staging: torch.Tensor) -> torch.Tensor:
        topo = self.topology
        if topo.local_rank == 0:
            staging[lay.numel : lay.padded].zero_()
            for e in unique:
                staging[e.offset : e.offset + e.numel].copy_(e.param.data.reshape(-1))
        topo.local_barrier()
        master = staging[lay.start : lay.stop].clone()
        topo.local_barrier()  # local rank 0 writes the next unit only after every rank took this one
        return master

    def publish(self, unit: ParamUnit) -> None:
        """Make this machine's copy of ``unit`` whole after every rank wrote its own shard into its machine's copy."""
        topo, lay = self.topology, self.layouts[unit.index]
        padded = self.padded_view(unit)
        if topo.num_nodes > 1:
            gathered = torch.empty(topo.num_nodes * lay.shard, dtype=self.stream_dtype)
            with topo.collective(f"the all-gather of the updated shards of {unit.label} across machines"):
                all_gather_flat(gathered, padded[lay.start : lay.stop], group=topo.cross_group)
            size = lay.shard
            for n, rank in enumerate(topo.cross_ranks):
                if rank != topo.rank:
                    padded[rank * size : (rank + 1) * size].copy_(gathered[n * size : (n + 1) * size])
        topo.local_barrier()

    def write_shard(self, unit: ParamUnit) -> None:
        """Cast this rank's master shard into the shared copy (after a load), then make the copy whole."""
        if not self.masters_are_shared:
            lay = self.layouts[unit.index]
            self.padded_view(unit)[lay.start : lay.stop].copy_(unit.master)
        self.publish(unit)

    def shard_state(self) -> dict[str, torch.Tensor]:
        """This rank's master shards by unit label, as tensors of their own (not views of the shared file)."""
        return {u.label: u.master.clone() if self.masters_are_shared else u.master for u in self.units}

    def load_shard_state(self, state: dict[str, torch.Tensor]) -> None:
        missing = [u.label for u in self.units if u.label not in state]
        if missing:
            raise ValueError(f"the checkpoint holds no shard of {missing[0]}: it was not saved by a multi-process"
                             " lazytrain run; load it into the model before training (its weights) instead")
        for unit in self.units:
            saved = state[unit.label]
            if saved.shape != unit.master.shape:
                raise ValueError(f"checkpoint shard of {unit.label} has {saved.numel()} elements, this rank owns"
                                 f" {unit.master.numel()}: resume with the world size the checkpoint was saved with")
            unit.master.copy_(saved)
            self.write_shard(unit)
            self.versions.written(unit)  # device copies made before the load are stale


    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return self.shard_state()

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> bool:
        self.load_shard_state(state)
        return True


def _reserve(path: str, nbytes: int) -> None:
    """Allocate the file's pages now: a full tmpfs then fails here with ENOSPC instead of a SIGBUS at first write."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, max(nbytes, 1))
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise MemoryError(
            f"lazytrain could not reserve {nbytes / 2**30:.2f} GiB for the shared streamed copy in"
            f" {os.path.dirname(path)} ({exc.strerror}); enlarge /dev/shm (docker: --shm-size) or point"
            " LAZYTRAIN_SHM_DIR at a tmpfs with room"
        ) from exc
    os.close(fd)


def _bind(entries: list[ParamEntry], unique: list[ParamEntry], stream: torch.Tensor) -> None:
    """Point the parameters at their place in the streamed copy. A parameter on the meta device cannot take CPU
    data, so it is replaced by a new Parameter in every slot it fills (tied weights stay one parameter)."""
    fresh: dict[int, nn.Parameter] = {}
    for e in unique:
        view = stream[e.offset : e.offset + e.numel].view(e.shape)
        if e.param.is_meta:
            fresh[e.uid] = nn.Parameter(view, requires_grad=e.param.requires_grad)
        else:
            e.param.data = view
    for e in [*unique, *entries] if fresh else []:
        if e.uid in fresh:
            e.param = e.module._parameters[e.name] = fresh[e.uid]


def _check_same_weights(labels: list[str], units: list[list[ParamEntry]], topo: Topology) -> bool:
    """Every rank must start from the same weights (each slices its own shard from them): compare checksums.

    A rank that built the model on the meta device has no weights to compare; it takes its machine's local rank 0
    copy, which must be real. Returns whether such a rank is on this machine."""
    empty = any(e.param.is_meta for u in units for e in u)
    if empty and topo.local_rank == 0:
        raise ValueError(f"local rank 0 of machine {topo.node_rank} holds the model on the meta device: it loads the"
                         " weights for its machine, so build the model with weights there (only a machine's other"
                         " ranks may build it empty, as lazytrain's configure_model context does)")
    sums = torch.tensor([[0.0, 0.0, 1.0] if empty else
                         [sum(float(e.param.data.double().sum()) for e in u),
                          sum(float(e.param.data.double().square().sum()) for e in u), 0.0] for u in units],
                        dtype=torch.float64)
    every = torch.empty((topo.world_size * sums.shape[0], 3), dtype=torch.float64)
    all_gather_flat(every, sums, group=topo.host_group)
    every = every.view(topo.world_size, -1, 3)
    is_empty = every[:, :, 2] > 0
    close = torch.isclose(every[:, :, :2], every[0:1, :, :2], rtol=1e-9, atol=1e-12).all(dim=2) | is_empty
    if not bool(close.all()):
        rank, unit = (int(i) for i in (~close).nonzero()[0])
        raise ValueError(f"rank {rank} starts from different weights than rank 0 (first in {labels[unit]}); seed the"
                         " model's initialisation (lightning.seed_everything) or load the same checkpoint everywhere")
    first = topo.node_rank * topo.local_world
    return bool(is_empty[first : first + topo.local_world].any())
