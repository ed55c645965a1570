"""Packing several samples into one row so that each sample still sees only itself.

A packed row carries ``position_ids`` that restart at 0 for every sample; its batch has no ``attention_mask`` and
``use_cache=False`` (`SFTCollator`), so from those positions transformers' mask builder
(``find_packed_sequence_indices``) limits attention to each sample, for ``eager``, ``sdpa`` and flex attention
alike, and flash-attention reads the same positions as variable-length sequences. The first label of every sample
is ignored, as it is in the sample alone (nothing predicts a first token), so the token before it in the row is not
trained to predict the next sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example


def _row(samples: Sequence[Example]) -> Example:
    ids = torch.cat([torch.as_tensor(e.input_ids, dtype=torch.int32) for e in samples])
    labels, positions = [], []
    for e in samples:
        own = torch.as_tensor(e.labels, dtype=torch.int32).clone()
        own[0] = IGNORE_INDEX
        labels.append(own)
        positions.append(torch.arange(len(own), dtype=torch.int32))
    return Example(ids, torch.cat(labels), ids[:0], None, torch.cat(positions))


def pack_examples(examples: Sequence[Example], max_seq_length: int) -> list[Example]:
    """Greedy in-order packing of whole samples into rows of at most ``max_seq_length`` tokens.

    Samples are never split, so every label keeps its own prompt as context.
    """
    packed: list[Example] = []
    row: list[Example] = []
    length = 0
    for ex in examples:
        if row and length + len(ex.input_ids) > max_seq_length:
            packed.append(_row(row))
            row, length = [], 0
        row.append(ex)
        length += len(ex.input_ids)
    if row:
        packed.append(_row(row))
    return packed
