"""Records to tokenized examples: labels on the assistant turns (or every token of plain text), truncation.

Large sets are tokenized in chunks, on ``num_proc`` processes with a progress bar: rendering a chat template is
Python (Jinja) work that one process does at a few thousand rows a second.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.answers import reference_answer
from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example
from lightning_lazytrain.sft.data.formats import Record
from lightning_lazytrain.sft.data.template import assistant_spans, generation_prompt, turn_closer, with_system

# (input ids, trained mask, prompt ids, reference answer) as numpy arrays: cheap to send back from a worker
_Raw = tuple[np.ndarray, np.ndarray, np.ndarray, str | None]


@dataclass(frozen=True)
class TokenizeSettings:
    """What decides the tokens of a record besides the tokenizer (all of it is in the cache key)."""

    max_seq_length: int
    system_prompt: str | None = None
    assistant_turns: str = "all"  # "all" assistant turns are trained, or only the "last"


def _trained(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Tokens whose characters overlap a trained span (a token that straddles its start is part of the reply)."""
    bounds = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = bounds[:, 0], np.maximum(bounds[:, 1], bounds[:, 0] + 1)
    mask = np.zeros(len(starts), dtype=bool)
    for lo, hi in spans:
        mask |= (starts < hi) & (ends > lo)
    return mask


def _chat_rows(tok: PreTrainedTokenizerBase, records: Sequence[Record], cfg: TokenizeSettings) -> list[_Raw]:
    closer = turn_closer(tok)
    texts, spans, prompts = [], [], []
    for rec in records:
        messages = with_system(rec, cfg.system_prompt)
        text, trained = assistant_spans(tok, rec, messages, closer, last_only=cfg.assistant_turns == "last")
        texts.append(text)
        spans.append(trained)
        prompts.append(generation_prompt(tok, messages))
    enc = tok(texts, add_special_tokens=False, return_offsets_mapping=True)
    prompt_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    return [
        (
            np.asarray(ids, dtype=np.int32),
            _trained(offsets, s),
            np.asarray(p, dtype=np.int32),
            reference_answer(rec.response),
        )
        for rec, ids, offsets, s, p in zip(
            records, enc["input_ids"], enc["offset_mapping"], spans, prompt_ids, strict=True
        )
    ]


def _text_rows(tok: PreTrainedTokenizerBase, records: Sequence[Record]) -> list[_Raw]:
    out = []
    for ids in tok([r.response for r in records])["input_ids"]:
        if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
            ids = [*ids, tok.eos_token_id]  # continued pre-training learns where a document ends
        out.append((np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool), np.zeros(0, np.int32), None))
    return out


def _chunk(tok: PreTrainedTokenizerBase, records: Sequence[Record], cfg: TokenizeSettings) -> list[_Raw]:
    return _text_rows(tok, records) if records and records[0].is_text else _chat_rows(tok, records, cfg)


def _example(raw: _Raw, max_seq_length: int) -> Example | None:
    ids, trained, prompt, answer = raw
    ids, trained = torch.from_numpy(ids[:max_seq_length]), torch.from_numpy(trained[:max_seq_length])
    if not bool(trained[1:].any()):  # the first token is never predicted
        return None
    labels = torch.where(trained, ids, torch.tensor(IGNORE_INDEX, dtype=torch.int32))
    return Example(ids, labels, torch.from_numpy(prompt), answer)


def tokenize_records(
    tok: PreTrainedTokenizerBase,
    records: Sequence[Record],
    max_seq_length: int,
    system_prompt: str | None = None,
    assistant_turns: str = "all",
    num_proc: int = 1,
    chunk_size: int = 4096,
) -> tuple[list[Example], int]:
    """Tokenize with labels on the assistant turns; returns (examples, number skipped for having no label left).

    Over-long samples are cut at ``max_seq_length`` from the end. A sample with no trained token left in the budget
    (its prompt alone fills it) is dropped and counted instead.
    """
    cfg = TokenizeSettings(max_seq_length, system_prompt, assistant_turns)
    chunks = [records[i : i + chunk_size] for i in range(0, len(records), chunk_size)]
    bar = tqdm(total=len(records), desc="tokenizing", unit="rows", disable=len(chunks) < 2)
    raws: list[_Raw] = []
    if num_proc > 1 and len(chunks) > 1:
        with ProcessPoolExecutor(min(num_proc, len(chunks))) as pool:
            for chunk, done in zip(
                chunks, pool.map(_chunk, [tok] * len(chunks), chunks, [cfg] * len(chunks)), strict=True
            ):
                raws.extend(done)
                bar.update(len(chunk))
    else:
        for chunk in chunks:
            raws.extend(_chunk(tok, chunk, cfg))
            bar.update(len(chunk))
    bar.close()
    examples = [_example(raw, max_seq_length) for raw in raws]
    kept = [e for e in examples if e is not None]
    return kept, len(examples) - len(kept)
