"""Host-side home of every parameter: flat per-unit master buffers and the streamed copy.

A *unit* (``layout.ParamUnit``) is what moves as one piece: one decoder layer, or the resident set (embedding,
final norm, head). Each unit owns one flat master buffer, and the module's parameters are re-pointed to views of
it, so the optimizer, ``state_dict`` and ``load_state_dict`` all see ordinary CPU parameters while the engine moves
one contiguous block. The streamed copy (bf16 under bf16-mixed) is a second flat buffer, pinned once here; where
the master already has the compute dtype the master itself is pinned and streamed. The masters cover only the
unit's trainable prefix (``layout.py``): a frozen parameter (a LoRA base) is held once, as its streamed copy, and
the module's parameter views that copy (bf16 under bf16-mixed); a bitsandbytes 4-bit weight is held there as its
packed codes and quant state (``packed4bit.py``). Which version of each unit the buffers hold, and whether an
update is still writing them, is ``versions.WeightVersions``'s (``store.versions``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_lazytrain.engine.weights.layout import ParamUnit, collect_entries, trainable_numel
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
        entries, unique, total = collect_entries(modules, self.stream_dtype.itemsize)
        trained = trainable_numel(unique)
        if self.master_dtype == self.stream_dtype:
            stream = master = self.pinned.empty(total, self.master_dtype)
        else:
            master, stream = torch.empty(trained, dtype=self.master_dtype), self.pinned.empty(total, self.stream_dtype)
        for entry in unique:
            home = master if entry.offset < trained else stream
            if entry.packed is not None:
                entry.packed.place(home[entry.offset : entry.offset + entry.numel], entry.param)
                continue
            view = home[entry.offset : entry.offset + entry.numel].view(entry.shape)
            view.copy_(entry.param.data)
            entry.param.data = view
        return ParamUnit(index, label, entries, total, master, stream, unique=unique, trainable_numel=trained)

    @property
    def held_bytes(self) -> int:
        """Host bytes of every unit's masters and streamed copy (one buffer where they are the same)."""
        return sum(_nbytes(u.master) + (_nbytes(u.stream) if u.stream.data_ptr() != u.master.data_ptr() else 0)
                   for u in self.units)

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


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
