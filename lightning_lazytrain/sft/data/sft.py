"""Supervised fine-tuning data: chat template, response-only labels, truncation, split, packing, collate."""

from __future__ import annotations

import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.answers import reference_answer
from lightning_lazytrain.sft.data.errors import EmptyDataError
from lightning_lazytrain.sft.data.formats import FieldMap, Record, read_records
from lightning_lazytrain.sft.data.sampler import ResumableDataLoader, ResumableRandomSampler
from lightning_lazytrain.sft.data.settings import DEMO_DATA, check_settings, resolve_data_path
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer

#: label value that cross-entropy ignores (the prompt, padding)
IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized sample. ``prompt_ids`` (the prompt up to the opened assistant turn) drives generation.

    Token sequences are int32 tensors (lists are accepted too): a 400k-row set as Python int lists would take
    ~10 GB of host RAM that the offloaded model states need.
    """

    input_ids: Sequence[int] | torch.Tensor
    labels: Sequence[int] | torch.Tensor
    prompt_ids: Sequence[int] | torch.Tensor
    answer: str | None


def _messages(prompt: str, system_prompt: str | None) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return head + [{"role": "user", "content": prompt}]


def render(tok: PreTrainedTokenizerBase, prompt: str, response: str, system_prompt: str | None) -> tuple[str, str]:
    """(prompt text ending with the opened assistant turn, completion text) as the chat template renders them.

    The completion is whatever the template adds after the prompt, so it includes the end-of-turn token; it is
    tokenized separately from the prompt so the label boundary sits exactly where generation starts.
    """
    msgs = _messages(prompt, system_prompt)
    prompt_text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": response}], tokenize=False)
    if full.startswith(prompt_text):
        return prompt_text, full[len(prompt_text) :]
    # a template that renders the last assistant turn differently from the generation prompt (e.g. strips a think
    # block): fall back to prompt + response + end of turn, which is what the model will see when generating
    return prompt_text, response + "<|im_end|>\n"


def tokenize_records(
    tok: PreTrainedTokenizerBase,
    records: Sequence[Record],
    max_seq_length: int,
    system_prompt: str | None = None,
    chunk_size: int = 4096,
) -> tuple[list[Example], int]:
    """Tokenize with labels only on the completion; returns (examples, number skipped for having no label left).

    Over-long samples are cut at ``max_seq_length`` from the end (the response tail goes first). A sample whose
    prompt alone fills the budget would train on nothing, so it is dropped and counted instead. Records are
    tokenized in chunks so the tokenizer's Python lists never hold the whole set at once.
    """
    examples: list[Example] = []
    skipped = 0
    for start in range(0, len(records), chunk_size):
        chunk = records[start : start + chunk_size]
        pairs = [render(tok, r.prompt, r.response, system_prompt) for r in chunk]
        prompts = tok([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
        completions = tok([c for _, c in pairs], add_special_tokens=False)["input_ids"]
        for rec, p_ids, c_ids in zip(chunk, prompts, completions, strict=True):
            n_prompt = len(p_ids)
            if n_prompt >= max_seq_length or not c_ids:
                skipped += 1
                continue
            ids = torch.tensor((p_ids + c_ids)[:max_seq_length], dtype=torch.int32)
            labels = ids.clone()
            labels[:n_prompt] = IGNORE_INDEX
            examples.append(Example(ids, labels, ids[:n_prompt], reference_answer(rec.response)))
    return examples, skipped


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded shuffle cut at ``val_fraction``: the same split for the same (n, fraction, seed), disjoint, complete."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)  # both sides non-empty whenever a split was asked for
    return order[n_val:], order[:n_val]


def pack_examples(examples: Sequence[Example], max_seq_length: int) -> list[Example]:
    """Greedy in-order packing of whole samples into rows of at most ``max_seq_length`` tokens.

    Samples are never split, so every label keeps its own prompt as context. Attention is not blocked between the
    samples of a row (plain causal mask), the usual trade for not wasting compute on padding.
    """
    packed: list[Example] = []
    row: list[Example] = []
    length = 0

    def flush() -> None:
        ids = torch.cat([torch.as_tensor(e.input_ids, dtype=torch.int32) for e in row])
        labels = torch.cat([torch.as_tensor(e.labels, dtype=torch.int32) for e in row])
        packed.append(Example(ids, labels, ids[:0], None))

    for ex in examples:
        if row and length + len(ex.input_ids) > max_seq_length:
            flush()
            row, length = [], 0
        row.append(ex)
        length += len(ex.input_ids)
    if row:
        flush()
    return packed


class SFTDataset(Dataset):
    def __init__(self, examples: Sequence[Example]) -> None:
        self.examples = list(examples)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]


class SFTCollator:
    """Right-pads ``input_ids``/``labels`` (with ``attention_mask``); with ``generation`` also left-pads the prompts.

    Left padding for generation keeps every prompt's last token in the last column, so batched greedy decoding
    appends new tokens right after each prompt.
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
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, e in enumerate(batch):
            n = len(e.input_ids)
            ids[row, :n] = torch.as_tensor(e.input_ids)
            labels[row, :n] = torch.as_tensor(e.labels)
            mask[row, :n] = 1
        out: dict[str, object] = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        if self.generation:
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


class SFTDataModule(pl.LightningDataModule):
    """MetaMathQA-style SFT data for ``CausalLMModule``.

    Args:
        data_path: a .json/.jsonl file, a local directory holding a hub dataset's data files, or ``"demo"`` for the
            shipped arithmetic set.
        tokenizer: model name or local path to take the tokenizer from; ``None`` uses the offline Qwen tokenizer.
        data_format: ``"metamath"`` (prompt_key/response_key), ``"alpaca"`` (instruction/input/output), ``"custom"``
            (the keys below), ``"auto"`` (the keys below, alpaca when a row has instruction+output instead).
        max_seq_length: tokens per sample after the chat template; longer samples lose their tail, and samples whose
            prompt alone fills it are dropped (counted in ``skipped``, with a warning).
        val_fraction: held-out share (the paper's 70/30 split is 0.3), split by a seeded shuffle.
        max_samples: keep only this many records (taken from the shuffled order, before the split).
        packing: pack several training samples per row (validation is never packed: it needs each prompt).
        max_eval_samples: cap on held-out samples the validation loop sees (generation is slow); ``None`` = all.

    Bad arguments raise :class:`DataSettingError` here; bad or missing data raise another :class:`DataError` at
    ``setup``, as does a set with no trainable sample left (or no held-out one when ``val_fraction > 0``).
    """

    def __init__(
        self,
        data_path: str = DEMO_DATA,
        tokenizer: str | None = None,
        data_format: Literal["auto", "metamath", "alpaca", "custom"] = "auto",
        prompt_key: str = "query",
        response_key: str = "response",
        input_key: str | None = None,
        system_prompt: str | None = None,
        max_seq_length: int = 1024,
        val_fraction: float = 0.3,
        seed: int = 42,
        max_samples: int | None = None,
        batch_size: int = 8,
        eval_batch_size: int | None = None,
        max_eval_samples: int | None = None,
        packing: bool = False,
        pad_to_multiple_of: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_settings(self.hparams)
        self.data_path = str(resolve_data_path(data_path))
        self.fields = FieldMap.for_format(data_format, prompt_key, response_key, input_key)
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self.train_set: SFTDataset | None = None
        self.val_set: SFTDataset | None = None
        self.skipped = 0

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.hparams.tokenizer)
        return self._tokenizer

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return  # fit then validate/test in one process: tokenize once
        hp = self.hparams
        records = read_records(Path(self.data_path), self.fields, hp.data_format)
        train_idx, val_idx = split_indices(len(records), hp.val_fraction, hp.seed)
        if hp.max_samples is not None:
            # cap each side in proportion so the split itself does not move when the cap changes
            n_val = round(hp.max_samples * hp.val_fraction)
            train_idx, val_idx = train_idx[: hp.max_samples - n_val], val_idx[:n_val]
        if hp.max_eval_samples is not None:
            val_idx = val_idx[: hp.max_eval_samples]
        train, skip_t = tokenize_records(self.tokenizer, [records[i] for i in train_idx], hp.max_seq_length,
                                         hp.system_prompt)
        val, skip_v = tokenize_records(self.tokenizer, [records[i] for i in val_idx], hp.max_seq_length,
                                       hp.system_prompt)
        self.skipped = skip_t + skip_v
        if self.skipped:
            warnings.warn(
                f"{self.data_path}: skipped {self.skipped} of {len(train_idx) + len(val_idx)} samples whose prompt "
                f"fills max_seq_length={hp.max_seq_length} (no response token would be trained on)",
                stacklevel=2,
            )
        if not train_idx:
            raise EmptyDataError(f"no training sample: max_samples={hp.max_samples} at val_fraction={hp.val_fraction}"
                                 " leaves none for training", "Raise max_samples or lower val_fraction",
                                 source=self.data_path)
        if not train:
            raise EmptyDataError(
                f"no training sample left: all {len(train_idx)} have a prompt that fills max_seq_length="
                f"{hp.max_seq_length} tokens with the chat template, so no response token would be trained on",
                "Raise max_seq_length or shorten the prompts", source=self.data_path)
        if not val and hp.val_fraction > 0 and hp.max_eval_samples != 0:
            if val_idx:
                why = f"all {len(val_idx)} have a prompt that fills max_seq_length={hp.max_seq_length}"
            else:
                why = f"val_fraction={hp.val_fraction} of {len(records)} records (max_samples={hp.max_samples}) is none"
            raise EmptyDataError(f"no held-out sample left: {why}",
                                 "Raise max_seq_length / max_samples, or set val_fraction=0 to train without "
                                 "validation", source=self.data_path)
        self.train_set = SFTDataset(pack_examples(train, hp.max_seq_length) if hp.packing else train)
        self.val_set = SFTDataset(val)

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def train_dataloader(self) -> DataLoader:
        collate = SFTCollator(self._pad_id(), pad_to_multiple_of=self.hparams.pad_to_multiple_of)
        # same sample order for the same seed; its place mid-epoch is saved in checkpoints, so a resume continues it
        sampler = ResumableRandomSampler(self.train_set, seed=self.hparams.seed)
        return ResumableDataLoader(self.train_set, batch_size=self.hparams.batch_size, sampler=sampler,
                                   collate_fn=collate, num_workers=self.hparams.num_workers)

    def _eval_loader(self) -> DataLoader:
        collate = SFTCollator(self._pad_id(), generation=True, pad_to_multiple_of=self.hparams.pad_to_multiple_of)
        return DataLoader(self.val_set, batch_size=self.hparams.eval_batch_size or self.hparams.batch_size,
                          shuffle=False, collate_fn=collate, num_workers=self.hparams.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader()
