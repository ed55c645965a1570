"""Batches: right-padded samples with labels, left-padded generation prompts, positions of packed rows."""

from __future__ import annotations

from typing import Any

import torch

from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example


class SFTCollator:
    """Right-pads ``input_ids``/``labels`` (with ``attention_mask``); with ``generation`` also left-pads the prompts.

    Left padding for generation keeps every prompt's last token in the last column, so batched greedy decoding
    appends new tokens right after each prompt. A batch of packed rows carries ``position_ids`` and
    ``use_cache=False`` instead of the ``attention_mask``: a 2D mask, even all ones, stops transformers from
    confining attention to each sample, and so does the (empty) cache a model makes when ``use_cache`` is left to
    its config's default. So ``model(**batch)`` keeps the samples apart as it is. The padding after a row gets
    positions counting from 0, a sample of its own that comes after every real token, so none attends to it.
    """

    def __init__(self, pad_id: int, generation: bool = False, pad_to_multiple_of: int | None = None) -> None:
        self.pad_id, self.generation, self.multiple = pad_id, generation, pad_to_multiple_of

    def _width(self, lengths: list[int]) -> int:
        width = max(lengths)
        if self.multiple:
            width = -(-width // self.multiple) * self.multiple
        return width

    def __call__(self, batch: list[Example]) -> dict[str, object]:
        width = self._width([len(e.input_ids) for e in batch])
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        packed = any(e.position_ids is not None for e in batch)
        positions = torch.zeros((len(batch), width), dtype=torch.long) if packed else None
        mask = None if packed else torch.zeros((len(batch), width), dtype=torch.long)
        for row, e in enumerate(batch):
            n = len(e.input_ids)
            ids[row, :n] = torch.as_tensor(e.input_ids)
            labels[row, :n] = torch.as_tensor(e.labels)
            if mask is not None:
                mask[row, :n] = 1
            if positions is not None:
                own = e.position_ids if e.position_ids is not None else torch.arange(n)
                positions[row, :n] = torch.as_tensor(own)
                positions[row, n:] = torch.arange(width - n)
        out: dict[str, object] = {"input_ids": ids, "labels": labels}
        if positions is not None:
            out.update(position_ids=positions, use_cache=False)
        else:
            out["attention_mask"] = mask
        if self.generation and all(len(e.prompt_ids) for e in batch):
            pwidth = max(len(e.prompt_ids) for e in batch)
            gen = torch.full((len(batch), pwidth), self.pad_id, dtype=torch.long)
            gmask = torch.zeros((len(batch), pwidth), dtype=torch.long)
            for row, e in enumerate(batch):
                n = len(e.prompt_ids)
                gen[row, pwidth - n :] = torch.as_tensor(e.prompt_ids)
                gmask[row, pwidth - n :] = 1
            out["gen_input_ids"], out["gen_attention_mask"] = gen, gmask
            out["answers"] = [e.answer or "" for e in batch]
        return out


MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "use_cache", "labels")


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of the model's forward in a collated batch: all but the generation prompts and answers."""
    return {key: batch[key] for key in MODEL_KEYS if key in batch}
