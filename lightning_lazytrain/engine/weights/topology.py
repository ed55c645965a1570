"""Who is who in a multi-process run: ranks, machines, and the host-side process groups the engine talks over.

The gradient reduce-scatter and the norm all-reduce go over the default group (NCCL between GPUs, gloo on the
CPU). Everything that touches host memory goes over gloo groups made here: ``local_group`` (the ranks of one
machine, which share one streamed copy) and ``cross_group`` (this local rank on every machine, which together
hold the shards a machine's copy is missing). Keeping them apart from the default group also lets the update
worker thread call them while the main thread runs the next backward's collectives.

Every collective of a step runs inside ``Topology.collective``: when one fails (a rank died: gloo sees its sockets
close at once; a rank hangs or is unreachable: the group's timeout) it raises ``PeerLostError`` naming what failed,
and every later collective of this process raises the same error at once instead of waiting out its own timeout,
so the updates still queued on the worker thread do not add one timeout each to the way out.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# torch 2.13 names the flat collectives ``*_single`` and deprecates ``all_gather_into_tensor`` and
# ``reduce_scatter_tensor``; the releases before it that we support have only the old names
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PeerLostError(RuntimeError):
    """A collective failed: another process of the run stopped, hangs past the timeout, or cannot be reached."""


@dataclass
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world: int
    node_rank: int
    num_nodes: int
    host_group: Any = None
    local_group: Any = None
    cross_group: Any = None
    token: str = ""
    timeout_s: float = 1800.0
    lost: str | None = None  # the message of the first collective that failed

    @property
    def cross_ranks(self) -> list[int]:
        """Global ranks in ``cross_group``, in group order: this local rank on machine 0, 1, ..."""
        return [n * self.local_world + self.local_rank for n in range(self.num_nodes)]

    def local_barrier(self) -> None:
        if self.local_world > 1:
            with self.collective("the barrier of this machine's ranks"):
                dist.barrier(group=self.local_group)

    @contextmanager
    def collective(self, what: str) -> Iterator[None]:
        """Turn a failed collective into ``PeerLostError`` and stop this process's next collectives at once."""
        if self.lost is not None:
            raise PeerLostError(self.lost)
        try:
            yield
        except PeerLostError:
            raise
        except RuntimeError as exc:  # gloo: "Connection reset/closed by peer", "Timed out"; NCCL: DistBackendError
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:400]
            self.lost = (
                f"lazytrain rank {self.rank} of {self.world_size}: {what} failed: another process of this run has"
                f" stopped, or hangs (no answer within timeout_s={self.timeout_s:g} s), or cannot be reached"
                f" ({first}). This process stops too. The first error is in the log of the process that stopped;"
                " resume from the last checkpoint with the same number of processes."
            )
            raise PeerLostError(self.lost) from exc


def build_topology(rank: int, world_size: int, local_rank: int, node_rank: int, num_nodes: int,
                   timeout: timedelta) -> Topology:
    """Make the gloo groups (every rank must call this, in the same order) and agree on a run token.

    Ranks must be numbered machine by machine (``rank = node_rank * local_world + local_rank``), as Lightning's
    ``set_world_ranks`` does; the shard a rank owns and the machine it writes into are derived from that.
    """
    if world_size % num_nodes:
        raise ValueError(f"world size {world_size} is not a multiple of num_nodes={num_nodes}")
    local_world = world_size // num_nodes
    if rank != node_rank * local_world + local_rank:
        raise ValueError(
            f"lazytrain needs ranks numbered machine by machine; got global rank {rank} for node {node_rank},"
            f" local rank {local_rank} with {local_world} processes per machine"
        )
    topo = Topology(rank, world_size, local_rank, local_world, node_rank, num_nodes, timeout_s=timeout.total_seconds())
    topo.host_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo",
                                                                                           timeout=timeout)
    for n in range(num_nodes):
        group = dist.new_group([n * local_world + j for j in range(local_world)], backend="gloo", timeout=timeout)
        if n == node_rank:
            topo.local_group = group
    for j in range(local_world):
        group = dist.new_group([n * local_world + j for n in range(num_nodes)], backend="gloo", timeout=timeout)
        if j == local_rank:
            topo.cross_group = group
    # A fresh name for this run's shared-memory files, so a crashed run's leftovers are never opened.
    token = [secrets.token_hex(6) if rank == 0 else None]
    dist.broadcast_object_list(token, src=0, group=topo.host_group)
    topo.token = token[0]
    return topo
