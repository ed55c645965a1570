"""Each rank updates its shard of every unit on a worker thread, then makes its machine's copy whole.

The engine owns a second ``HybridAdamW`` over *pieces*: for every unit, the parts of its trainable parameters that
fall inside this rank's shard, as 1-D views of the master shard. AdamW is elementwise, so updating pieces is the
same arithmetic as updating whole tensors (8-bit block boundaries and stochastic-rounding keys follow the pieces).
The user's optimizer stays the one Lightning, LR schedulers and callbacks see; its hyperparameters are copied
into the pieces' groups at every step, and it never allocates moment tensors (``defer_state_allocation``).

Jobs run in the order the next forward needs the units, as in ``UpdateQueue``; after the update, ``publish``
fetches the other machines' shards of the unit and waits for the machine's other ranks, so the next forward's
read of unit ``i`` waits only for job ``i``. The CPU threads of the update are this rank's share of the machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from lightning_lazytrain.engine.device import host_wait
from lightning_lazytrain.engine.grads.handoff import HandoffSink
from lightning_lazytrain.engine.updates.cpu import UnitUpdateQueue
from lightning_lazytrain.engine.weights.layout import ParamEntry, ParamUnit
from lightning_lazytrain.engine.weights.shared_store import SharedParamStore
from lightning_lazytrain.optim import HybridAdamW


@dataclass
class Piece:
    tensor: torch.Tensor
    entry: ParamEntry
    lo: int
    hi: int


def shard_optimizer(user: HybridAdamW, store: SharedParamStore) -> tuple[HybridAdamW, dict[int, list[Piece]]]:
    """A HybridAdamW over this rank's pieces of the parameters ``user`` manages, group by group."""
    group_of = {id(p): i for i, g in enumerate(user.param_groups) for p in g["params"]}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in user.param_groups]
    pieces: dict[int, list[Piece]] = {}
    for unit, lay in zip(store.units, store.layouts):
        pieces[unit.index] = []
        for e in unit.unique:
            part = lay.overlap(e.offset, e.numel)
            if id(e.param) not in group_of or part is None:
                continue
            piece = Piece(unit.master[part[0] : part[1]], e, *part)
            pieces[unit.index].append(piece)
            groups[group_of[id(e.param)]]["params"].append(piece.tensor)
    threads = max(1, (user.num_threads or len(os.sched_getaffinity(0))) // store.topology.local_world)
    shard = HybridAdamW(groups, eight_bit_fraction=user.eight_bit_fraction, block_size=user.block_size,
                        min_8bit_numel=user.min_8bit_numel, seed=user.seed, num_threads=threads)
    if not store.masters_are_shared:
        for unit, lay in zip(store.units, store.layouts):
            padded = store.padded_view(unit)
            for piece in pieces[unit.index]:
                shard.register_stream_copy(piece.tensor, padded[lay.start + piece.lo : lay.start + piece.hi])
    return shard, pieces


class ShardedUpdateQueue(UnitUpdateQueue):
    def __init__(self, user: HybridAdamW, store: SharedParamStore, sink: HandoffSink, timeout_s: float) -> None:
        shard, self._pieces = shard_optimizer(user, store)
        super().__init__(shard, store.versions, sink, timeout_s)
        self.user, self.store = user, store

    def sync_hyperparameters(self) -> None:
        """Copy lr, betas, ... from the user's groups (where schedulers change them) into the pieces' groups."""
        for mine, theirs in zip(self.optimizer.param_groups, self.user.param_groups):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def state_dict(self) -> dict:
        """The shard optimizer's state, with the hyperparameters the user's optimizer has now."""
        self.sync_hyperparameters()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the shard states, and the saved hyperparameters into the user's groups (schedulers read them)."""
        self.optimizer.load_state_dict(state)
        for mine, theirs in zip(self.optimizer.param_groups, self.user.param_groups):
            theirs.update({k: v for k, v in mine.items() if k != "params"})

    def enqueue(self, clip_coef: float) -> None:
        self.sync_hyperparameters()
        coef = clip_coef / self.store.topology.world_size  # the reduce-scatter summed; this makes it the mean
        self._submit(coef)

    def _run(self, unit: ParamUnit, coef: float, lr_of: dict[int, float]) -> None:
        handoff = self.sink.of(unit)
        host_wait(handoff.ready, f"the gradient shard of {unit.label}", self.timeout_s)
        handoff.refs = None
        chosen = [p for p in self._pieces[unit.index] if p.entry.param.requires_grad]
        grads = [handoff.host[p.lo : p.hi] for p in chosen]
        self.optimizer.step_params([p.tensor for p in chosen], coef, grads, lr_of)
        self.store.publish(unit)
        self.versions.written(unit)
