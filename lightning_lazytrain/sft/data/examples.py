"""Tokenized samples, and their flat on-disk form.

Token sequences are int32 tensors (lists are accepted too): a 400k-row set as Python int lists would take ~10 GB
of host RAM that the offloaded model states need. On disk (and in the cache) a set is a few flat tensors plus
offsets; the examples read back are views into them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

#: label value that cross-entropy ignores (the prompt, padding)
IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized sample. ``prompt_ids`` (the conversation up to the opened last assistant turn) drives
    generation; ``position_ids`` is set on packed rows only (positions restart at each sample)."""

    input_ids: Sequence[int] | torch.Tensor
    labels: Sequence[int] | torch.Tensor
    prompt_ids: Sequence[int] | torch.Tensor
    answer: str | None
    position_ids: torch.Tensor | None = None


def _flat(seqs: Sequence[Sequence[int] | torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [torch.as_tensor(s, dtype=torch.int32) for s in seqs]
    starts = torch.zeros(len(parts) + 1, dtype=torch.int64)
    if parts:
        starts[1:] = torch.tensor([len(p) for p in parts]).cumsum(0)
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)), starts


def examples_to_state(examples: Sequence[Example]) -> dict[str, Any]:
    """Unpacked examples as flat tensors (what ``torch.save`` writes; loadable with ``weights_only=True``)."""
    ids, starts = _flat([e.input_ids for e in examples])
    labels, _ = _flat([e.labels for e in examples])
    prompts, prompt_starts = _flat([e.prompt_ids for e in examples])
    return {
        "input_ids": ids,
        "labels": labels,
        "starts": starts,
        "prompt_ids": prompts,
        "prompt_starts": prompt_starts,
        "answers": [e.answer for e in examples],
    }


def examples_from_state(state: dict[str, Any]) -> list[Example]:
    s, p = state["starts"].tolist(), state["prompt_starts"].tolist()
    ids, labels, prompts = state["input_ids"], state["labels"], state["prompt_ids"]
    return [
        Example(ids[s[i] : s[i + 1]], labels[s[i] : s[i + 1]], prompts[p[i] : p[i + 1]], answer)
        for i, answer in enumerate(state["answers"])
    ]


class SFTDataset(Dataset):
    def __init__(self, examples: Sequence[Example]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]
