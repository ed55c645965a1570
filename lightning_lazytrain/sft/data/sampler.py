"""A data order that a checkpoint can hold: resuming mid-epoch continues with the next unseen sample.

Lightning saves and restores a train dataloader's place only when the dataloader itself has ``state_dict`` /
``load_state_dict`` (its ``CombinedLoader`` asks each loader, not the sampler), so both pieces are here:

* :class:`ResumableRandomSampler`: a seeded shuffle per epoch (``set_epoch``, which Lightning calls, picks the
  permutation), counting how many indices of the epoch it has yielded;
* :class:`ResumableDataLoader`: a ``DataLoader`` over such a sampler whose state counts the samples it has HANDED
  OUT, because worker processes draw indices from the sampler ahead of use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

__all__ = ["ResumableDataLoader", "ResumableRandomSampler"]


class ResumableRandomSampler(Sampler[int]):
    """Indices ``0..len(data_source)-1`` in a seeded random order per epoch (in order with ``shuffle=False``).

    The order of epoch ``e`` is ``torch.randperm`` under seed ``seed + e`` (the ``DistributedSampler`` convention),
    so it depends on nothing but (seed, epoch, length). ``position`` is how many indices of the current epoch's
    order have been yielded; iteration starts there, so after ``load_state_dict`` it continues where the saved run
    was. A pass that ran to the end starts the next one at 0.
    """

    def __init__(self, data_source: Sized, seed: int = 0, shuffle: bool = True) -> None:
        self.data_source = data_source
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        # a resume restores (epoch, position) and then Lightning calls set_epoch with the same epoch: keep the place
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0

    def order(self) -> list[int]:
        n = len(self)
        if not self.shuffle:
            return list(range(n))
        return torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        if self.position >= len(order):
            self.position = 0
        for i in range(self.position, len(order)):
            self.position = i + 1
            yield order[i]

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "shuffle": self.shuffle, "epoch": self.epoch, "position": self.position,
                "num_samples": len(self)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["num_samples"] != len(self):
            raise ValueError(
                f"the checkpoint's data order is for {state['num_samples']} samples but this dataset has {len(self)};"
                " resuming mid-epoch on other data would skip or repeat samples. Resume with the same data (same"
                " data_path, max_samples, val_fraction and seed), or start a new run from the weights only."
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]


class ResumableDataLoader(DataLoader):
    """``DataLoader(dataset, sampler=ResumableRandomSampler(...), ...)`` whose place in the epoch is checkpointed.

    Without a ``generator`` of its own, each epoch seeds the workers from (sampler seed, epoch) instead of drawing
    from the global RNG, so the global random stream does not depend on where a run was resumed.
    """

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, **kwargs)
        if not isinstance(self.sampler, ResumableRandomSampler):
            raise TypeError(
                f"ResumableDataLoader needs sampler=ResumableRandomSampler(...), got {type(self.sampler).__name__}"
            )
        self._own_generator = self.generator is None
        self._start = 0
        self._delivered = 0
        self._iterating = False

    def __iter__(self) -> Iterator[Any]:
        # a generator: nothing (not even the worker start) runs before the first next(), which Lightning calls only
        # after set_epoch has chosen the epoch's order
        sampler = self.sampler
        if self._own_generator:
            self.generator = torch.Generator().manual_seed(sampler.seed + sampler.epoch)
        self._start = sampler.position if sampler.position < len(sampler) else 0
        self._delivered, self._iterating = 0, True
        for batch in super().__iter__():
            self._delivered += 1
            yield batch
        self._iterating = False

    def state_dict(self) -> dict[str, Any]:
        state = self.sampler.state_dict()
        if self._iterating:
            per_batch = self.batch_size or 1
            state["position"] = min(len(self.sampler), self._start + self._delivered * per_batch)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
