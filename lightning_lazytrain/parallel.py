"""The process side of ``devices=N`` / ``num_nodes=M``: launching, ranks, the process group, Lightning collectives.

It follows Lightning's ``DDPStrategy``: the subprocess launcher re-runs the script once per extra local device
(or torchrun / SLURM / a user started them: Lightning's cluster environments tell), ranks come from the cluster
environment, ``setup_environment`` opens the process group (NCCL between GPUs, gloo on the CPU) and the engine's
host-side gloo groups (``engine/weights/topology.py``). With one process nothing of this runs: no launcher, no process
group, and ``reduce`` / ``barrier`` / ``broadcast`` return at once, exactly as a single-device strategy.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_lazytrain.engine.weights.topology import Topology, build_topology


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device; the subclass defines ``timeout_s`` (the process group's collective timeout)."""

    topology: Topology | None = None
    timeout_s: float = 1800.0

    @property
    def num_nodes(self) -> int:
        return getattr(self, "_num_nodes", 1)

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    @property
    def distributed(self) -> bool:
        return self.num_nodes * self.num_processes > 1

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's accelerator connector: True makes the trainer add a ``DistributedSampler``."""
        return self.distributed

    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[self.local_rank if self.num_processes > 1 else 0]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # A sharded checkpoint loads into the engine's shards, which exist only after setup.
        return self.distributed

    def _configure_launcher(self) -> None:
        if self.distributed:
            assert self.cluster_environment is not None
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def setup_environment(self) -> None:
        super().setup_environment()
        if self.distributed:
            self.setup_distributed()

    def setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device = self.root_device
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=self.timeout_s)
        kwargs: dict[str, Any] = {"timeout": timeout}
        if device.type == "cuda":
            kwargs["device_id"] = device
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self.topology = build_topology(self.global_rank, self.world_size, self.local_rank, self.node_rank,
                                       self.num_nodes, timeout)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src)
        return box[0]
