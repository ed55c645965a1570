"""One training sample as text with its loss mask: the first thing to check when a fine-tune goes wrong."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example

#: brackets around the trained text in the preview
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def describe_sample(tok: PreTrainedTokenizerBase, example: Example) -> str:
    """The sample's decoded tokens with every run of trained tokens (loss on them) between ``[[`` and ``]]``."""
    ids = torch.as_tensor(example.input_ids).tolist()
    trained = (torch.as_tensor(example.labels) != IGNORE_INDEX).tolist()
    pieces, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trained[i] != trained[start]:
            text = tok.decode(ids[start:i])
            pieces.append(f"{TRAINED_OPEN}{text}{TRAINED_CLOSE}" if trained[start] else text)
            start = i
    n_trained = sum(trained)
    head = (
        f"training sample ({len(ids)} tokens, {n_trained} trained on, shown between {TRAINED_OPEN} and "
        f"{TRAINED_CLOSE}):"
    )
    return head + "\n" + "".join(pieces)
