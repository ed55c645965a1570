"""The process side of ``devices=N`` / ``num_nodes=M``: launching, ranks, the process group, Lightning collectives.

It follows Lightning's ``DDPStrategy``: the subprocess launcher re-runs the script once per extra local device
(or torchrun / SLURM / a user started them: Lightning's cluster environments tell), ranks come from the cluster
environment, ``setup_environment`` opens the process group (NCCL between GPUs, gloo on the CPU) and the engine's
host-side gloo groups (``engine/weights/topology.py``). With one process nothing of this runs: no launcher, no process
group, and ``reduce`` / ``barrier`` / ``broadcast`` return at once, exactly as a single-device strategy, unless
``force_distributed`` is set: then one process runs the whole multi-process path (a process group of one rank,
sharded store and updates, sharded checkpoints), so it can be tested and timed on a machine with one device.

``ProcessGroup`` is the strategy's part that holds all this: the devices, node count and cluster environment
Lightning hands the strategy, the ranks, and the group once open. Everything else that differs between one process
and several is answered here too, so the strategy asks without branching: which host store (a private one, or the
machine's shared copy with sharded masters), how the optimizer is set up (without moment tensors when the engine
shards it), which update path runs, what admission counts per host, and whether the OOM ladder may re-plan this
process alone. How checkpoints are laid out over the processes is the checkpoint part's (``checkpointing.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_lazytrain import node_load
from lightning_lazytrain.engine import StreamingExecutor
from lightning_lazytrain.engine.grads.homes import STAGED_HOMES
from lightning_lazytrain.engine.updates.paths import UpdatePath, direct_path, host_path, sharded_path
from lightning_lazytrain.engine.weights.store import HostParamStore
from lightning_lazytrain.engine.weights.topology import Topology, build_topology
from lightning_lazytrain.optim.hybrid_adamw import defer_state_allocation
from lightning_lazytrain.planning.update_placement import DeviceUpdates, place_updates


def processes_attribute(name: str, settable: bool = False) -> property:
    """A strategy property that Lightning reads (and, ``settable``, sets) whose value its ``ProcessGroup`` holds."""

    def get(strategy: Any) -> Any:
        return getattr(strategy.processes, name)

    def put(strategy: Any, value: Any) -> None:
        setattr(strategy.processes, name, value)

    return property(get, put if settable else None, doc=f"The process group's ``{name}``.")


def processes_method(name: str) -> Callable[..., Any]:
    """A strategy method that Lightning calls and its ``ProcessGroup`` answers."""

    def call(strategy: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(strategy.processes, name)(*args, **kwargs)

    call.__name__ = name
    return call


class ProcessGroup:
    """This process among the run's: one per device. ``timeout_s`` is the process group's collective timeout;
    ``force_distributed`` runs the multi-process path with one process. The strategy forwards Lightning's
    ``parallel_devices``, ``num_nodes`` and ``cluster_environment`` here, set after it is built."""

    def __init__(self, timeout_s: float, force_distributed: bool) -> None:
        self.timeout_s, self.force_distributed = timeout_s, force_distributed
        self.devices: list[torch.device] | None = None
        self.num_nodes = 1
        self.cluster_environment: ClusterEnvironment | None = None
        self.topology: Topology | None = None

    @property
    def global_rank(self) -> int:
        return self.cluster_environment.global_rank() if self.cluster_environment is not None else 0

    @property
    def local_rank(self) -> int:
        return self.cluster_environment.local_rank() if self.cluster_environment is not None else 0

    @property
    def node_rank(self) -> int:
        return self.cluster_environment.node_rank() if self.cluster_environment is not None else 0

    @property
    def world_size(self) -> int:
        return self.cluster_environment.world_size() if self.cluster_environment is not None else 1

    @property
    def num_processes(self) -> int:
        """Processes on this node: one per device."""
        return len(self.devices) if self.devices else 1

    @property
    def distributed(self) -> bool:
        return self.force_distributed or self.num_nodes * self.num_processes > 1

    @property
    def root_device(self) -> torch.device:
        if not self.devices:
            return torch.device("cpu")
        return self.devices[self.local_rank if self.num_processes > 1 else 0]

    @property
    def sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def launcher(self) -> _SubprocessScriptLauncher | None:
        """Lightning's subprocess launcher when there are several processes (it re-runs the script per extra one)."""
        if not self.distributed:
            return None
        assert self.cluster_environment is not None
        return _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def open(self) -> None:
        """With several processes: the process group (NCCL between GPUs, gloo on the CPU) and the engine's groups."""
        if not self.distributed:
            return
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

    def _collective(self, what: str) -> AbstractContextManager[None]:
        """Lightning's collectives fail as the engine's do (``PeerLostError``) when another process is lost."""
        return self.topology.collective(what) if self.topology is not None else contextlib.nullcontext()

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            with self._collective("an all-reduce for Lightning (a logged metric)"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        with self._collective("a barrier for Lightning"):
            if torch.distributed.get_backend() == "nccl":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        with self._collective("a broadcast for Lightning"):
            torch.distributed.broadcast_object_list(box, src)
        return box[0]

    @contextlib.contextmanager
    def init_context(self, precision_plugin: Precision) -> Iterator[None]:
        """Where ``configure_model`` and ``Trainer.init_module`` build: on the host (the engine streams from host
        memory), and on the meta device on a machine's other local ranks, so each machine loads the weights once
        (local rank 0) and the others map its shared copy at setup (``node_load.py``)."""
        empty = self.distributed and self.local_rank > 0
        with node_load.init_context(empty), precision_plugin.tensor_init_context():
            yield

    def store_factory(self, module: pl.LightningModule) -> Callable[..., HostParamStore]:
        """One process: a private host store; several: the machine's shared streamed copy, masters sharded."""
        if self.distributed:
            return functools.partial(node_load.node_store, topology=self.topology, module=module)
        return HostParamStore

    def optimizer_setup(self) -> AbstractContextManager[None]:
        """Around ``setup_optimizers``: with several processes the engine's shard optimizer holds the states."""
        return defer_state_allocation() if self.distributed else contextlib.nullcontext()

    def update_path(self, executor: StreamingExecutor, training: bool, optimizer: torch.optim.Optimizer | None,
                    engine_can_update: bool, device_updates: DeviceUpdates, gradient_home: str = "host") -> UpdatePath:
        """The run's gradient/update path: for training, sharded with several processes (the only way they train),
        else the engine's per-unit updates when the optimizer and loop allow them, else host gradients for
        Lightning's optimizer step; evaluation runs no backward and gets the host path. ``gradient_home``
        (``grads/homes.py``) applies to the engine's per-unit updates; the others keep their gradients on the
        host."""
        store, queues, timeout = executor.store, executor.queues, executor.timeout_s
        if training and gradient_home in STAGED_HOMES and (self.distributed or not engine_can_update):
            raise ValueError(
                f"gradient_home={gradient_home!r} needs the engine's own updates in one process: one"
                " lightning_lazytrain.optim.HybridAdamW, automatic optimization, accumulate_grad_batches=1,"
                " overlap_updates=True and devices=1; or gradient_home='host' (or 'plan')"
            )
        if training and self.distributed:
            if not engine_can_update:
                raise ValueError(
                    "lazytrain with several processes shards the optimizer inside the engine: it needs one"
                    " lightning_lazytrain.optim.HybridAdamW, automatic optimization, accumulate_grad_batches=1 and"
                    " overlap_updates=True"
                )
            return sharded_path(store, queues, optimizer, timeout)
        if training and engine_can_update:
            itemsize = store.stream_dtype.itemsize
            placement = place_updates(store.units, optimizer, device_updates, queues.device, itemsize)
            return direct_path(store, queues, optimizer, placement, timeout, gradient_home,
                               executor.spill_dir)
        return host_path(store, queues, executor.slot_numel, timeout)

    @property
    def host_share(self) -> tuple[int, int]:
        """(processes on this host, processes in all): admission counts one host's share of the run."""
        topo = self.topology
        return (topo.local_world, topo.world_size) if topo is not None else (1, 1)

    @property
    def replans_alone(self) -> bool:
        """Whether this process may change its plan by itself (the OOM ladder): only when it is the only one."""
        return not self.distributed
