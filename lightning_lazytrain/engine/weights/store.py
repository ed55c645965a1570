"""Host-side home of every parameter: flat per-unit master buffers and the streamed copy.

A *unit* (``layout.ParamUnit``) is what moves as one piece: one decoder layer, or the resident set (embedding,
final norm, head). Each unit owns one flat master buffer, and the module's parameters are re-pointed to views of
it, so the optimizer, ``state_dict`` and ``load_state_dict`` all see ordinary CPU parameters while the engine moves
one contiguous block. The streamed copy (bf16 under bf16-mixed) is a second flat buffer, pinned once here; where
the master already has the compute dtype the master itself is pinned and streamed. Which version of each unit the
buffers hold, and whether an update is still writing them, is ``versions.WeightVersions``'s (``store.versions``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lazytrain.engine.weights.layout import ParamUnit, collect_entries
from lightning_lazytrain.engine.weights.pinned import PinnedAllocator
from lightning_lazytrain.engine.weights.versions import WeightVersions


class HostParamStore:
    """Owns the flat host buffers of all units and their versions (gradients belong to the run's sink,
    ``engine/grads/``)."""

    streams_from_masters = True  # each unit's streamed copy is cast from its own masters (not a shard of them)

    def __init__(
        self,
        groups: list[tuple[str, list[nn.Module]]],
        master_dtype: torch.dtype,
        stream_dtype: torch.dtype,
        pin: bool,
    ) -> None:
        self.master_dtype = master_dtype
        self.stream_dtype = stream_dtype
        self.pinned = PinnedAllocator(enabled=pin)
        self.units: list[ParamUnit] = self._build_units(groups)
        self.versions = WeightVersions(self.units, stale=self.streams_from_masters)
        for unit in self.units:
            self.versions.refresh(unit)

    def _build_units(self, groups: list[tuple[str, list[nn.Module]]]) -> list[ParamUnit]:
        return [self._build_unit(i, label, mods) for i, (label, mods) in enumerate(groups)]

    def _build_unit(self, index: int, label: str, modules: list[nn.Module]) -> ParamUnit:
        entries, unique, total = collect_entries(modules)
        same = self.master_dtype == self.stream_dtype
        master = self.pinned.empty(total, self.master_dtype) if same else torch.empty(total, dtype=self.master_dtype)
        for entry in unique:
            view = master[entry.offset : entry.offset + entry.numel].view(entry.shape)
            view.copy_(entry.param.data)
            entry.param.data = view
        stream = master if same else self.pinned.empty(total, self.stream_dtype)
        return ParamUnit(index, label, entries, total, master, stream, unique=unique)

    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def checkpoint_state(self) -> dict[str, torch.Tensor] | None:
        """The model state a checkpoint saves when it is not the module's ``state_dict`` (None: it is)."""
        return None

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> bool:
        """Load ``checkpoint_state()``'s dict; False when the module's ``load_state_dict`` does it."""
        return False

    def close(self) -> None:
        self.pinned.release()
