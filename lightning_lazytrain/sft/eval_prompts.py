"""The held-out prompts of one evaluation, gathered so they are decoded together instead of per validation batch.

Under lazytrain each decode step is one pass over the decoder layers (or over the layers made resident for the
evaluation), so one ``generate`` over every prompt serves them all with that pass; the strategy splits a batch
that does not fit the device. Prompts come left-padded per validation batch and are re-padded to the longest.
"""

from __future__ import annotations

import torch


class EvalPrompts:
    def __init__(self) -> None:
        self.prompts: list[torch.Tensor] = []
        self.answers: list[str] = []
        self.device: torch.device | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def clear(self) -> None:
        self.prompts, self.answers, self.device = [], [], None

    def add(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, answers: list[str]) -> None:
        """Keep each row's real tokens (on the host: a whole evaluation's prompts can be many)."""
        self.device = self.device or input_ids.device
        for ids, mask, answer in zip(input_ids.cpu(), attention_mask.cpu(), answers, strict=True):
            self.prompts.append(ids[mask.bool()])
            self.answers.append(answer)

    def batch(self, start: int, stop: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts ``start:stop`` left-padded to the longest of them, on the device the batches came on."""
        rows = self.prompts[start:stop]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=rows[0].dtype)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
        return ids.to(self.device), mask.to(self.device)


def new_token_count(new_ids: torch.Tensor, eos_id: int | None) -> int:
    """Tokens actually generated: each row up to and including its first end-of-turn (the rest is padding)."""
    if eos_id is None:
        return new_ids.numel()
    hit = new_ids == eos_id
    upto = torch.where(hit.any(1), hit.int().argmax(1) + 1, new_ids.shape[1])
    return int(upto.sum())
