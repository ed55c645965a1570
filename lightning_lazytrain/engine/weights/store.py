"""Host-side home of every parameter: flat per-unit master buffers and the streamed copy.

A *unit* is what moves as one piece: one decoder layer, or the resident set (embedding, final norm, head). Each
unit owns one flat master buffer, and the module's parameters are re-pointed to views of it, so the optimizer,
``state_dict`` and ``load_state_dict`` all see ordinary CPU parameters while the engine moves one contiguous block.
The streamed copy (bf16 under bf16-mixed) is a second flat buffer, pinned once here; where the master already
has the compute dtype the master itself is pinned and streamed.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_lazytrain.engine.weights.pinned import PinnedAllocator


@dataclass
class ParamEntry:
    module: nn.Module
    name: str
    param: nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    uid: int


@dataclass
class ParamUnit:
    index: int
    label: str
    entries: list[ParamEntry]
    numel: int
    master: torch.Tensor
    stream: torch.Tensor
    generation: int = 0
    dirty: bool = False
    unique: list[ParamEntry] = field(default_factory=list)
    pending_update: Future | None = None
    update_wait_seconds: float = 0.0

    def await_update(self, timeout_s: float = 600.0) -> None:
        """Block until an optimizer update of this unit that runs on a worker thread has finished.

        The time blocked is what the next step could not hide of the CPU optimizer (``update_wait_seconds``).
        """
        future, self.pending_update = self.pending_update, None
        if future is not None and not future.done():
            start = time.perf_counter()
            future.result(timeout=timeout_s)
            self.update_wait_seconds += time.perf_counter() - start
        elif future is not None:
            future.result()

    def refresh_stream(self) -> None:
        """Bring the streamed copy up to date with the masters (a cast, or nothing when they are one buffer)."""
        self.await_update()
        if self.dirty:
            if self.stream.data_ptr() != self.master.data_ptr():
                self.stream.copy_(self.master)
            self.generation += 1
            self.dirty = False


class HostParamStore:
    """Owns the flat host buffers of all units (gradients belong to the run's sink, ``engine/grads/``)."""

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
        unit = ParamUnit(index, label, entries, total, master, stream, unique=unique, dirty=True)
        unit.refresh_stream()
        return unit

    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def mark_dirty(self) -> None:
        """The masters changed (optimizer step, checkpoint load): streamed copies are stale until refreshed."""
        for unit in self.units:
            unit.dirty = True

    def checkpoint_state(self) -> dict[str, torch.Tensor] | None:
        """The model state a checkpoint saves when it is not the module's ``state_dict`` (None: it is)."""
        return None

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> bool:
        """Load ``checkpoint_state()``'s dict; False when the module's ``load_state_dict`` does it."""
        return False

    def close(self) -> None:
        self.pinned.release()


def collect_entries(modules: list[nn.Module]) -> tuple[list[ParamEntry], list[ParamEntry], int]:
    """The flat layout of one unit: every (module, name) slot, the distinct parameters in order, the total size.

    A parameter reached twice (tied weights) gets one place in the flat buffer; both slots point at it.
    """
    entries: list[ParamEntry] = []
    offsets: dict[int, int] = {}
    unique: list[ParamEntry] = []
    total = 0
    seen_modules: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for name, param in module._parameters.items():
                if param is None:
                    continue
                if id(param) not in offsets:
                    offsets[id(param)] = len(unique)
                    unique.append(ParamEntry(module, name, param, total, param.numel(), param.shape, len(unique)))
                    total += param.numel()
                first = unique[offsets[id(param)]]
                entries.append(ParamEntry(module, name, param, first.offset, first.numel, first.shape, first.uid))
    return entries, unique, total

