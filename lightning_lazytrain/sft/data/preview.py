"""One training sample as text with its loss mask: the first thing to check when a fine-tune goes wrong."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example

#: brackets around the trained text in the preview
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"
#: a longer sample shows its first and last this many tokens, with a marker for those between
EDGE_TOKENS = 128


def _text(tok: PreTrainedTokenizerBase, ids: list[int], trained: list[bool]) -> str:
    """``ids`` decoded, each run of trained tokens between the brackets."""
    pieces, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tok.decode(ids[start:i])
            pieces.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained[start] else text)
            start = i
    return "".join(pieces)


def describe_sample(tok: PreTrainedTokenizerBase, example: Example, edge_tokens: int = EDGE_TOKENS) -> str:
    """The sample's decoded tokens with every run of trained tokens (loss on them) between ``[[`` and ``]]``; of a
    sample longer than twice ``edge_tokens`` only the first and last ``edge_tokens`` (a trained run cut there is
    closed before the marker and opened again after it)."""
    ids = torch.as_tensor(example.input_ids).tolist()
    trained = (torch.as_tensor(example.labels) != IGNORE_INDEX).tolist()
    n_trained = sum(trained)
    head = (
        f"training sample ({len(ids)} tokens, {n_trained} trained on, shown between {TRAINED_OPEN} and "
        f"{TRAINED_CLOSE}):"
    )
    if len(ids) <= 2 * edge_tokens:
        return head + "\n" + _text(tok, ids, trained)
    hidden = len(ids) - 2 * edge_tokens
    marker = f" [... {hidden:,} tokens not shown ...] "
    first = _text(tok, ids[:edge_tokens], trained[:edge_tokens])
    last = _text(tok, ids[-edge_tokens:], trained[-edge_tokens:])
    return head + "\n" + first + marker + last
