"""`SFTDataModule`: records from a source, tokenized (or read from the cache), split, packed, batched."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.cache import (
    cache_key,
    default_cache_dir,
    load_cached,
    save_cached,
    tokenizer_fingerprint,
)
from lightning_lazytrain.sft.data.collate import SFTCollator
from lightning_lazytrain.sft.data.errors import EmptyDataError
from lightning_lazytrain.sft.data.examples import Example, SFTDataset
from lightning_lazytrain.sft.data.formats import FieldMap, Record, read_records
from lightning_lazytrain.sft.data.packing import pack_examples
from lightning_lazytrain.sft.data.preview import describe_sample
from lightning_lazytrain.sft.data.sampler import ResumableDataLoader, ResumableRandomSampler
from lightning_lazytrain.sft.data.settings import DEMO_DATA, check_settings, resolve_data_path
from lightning_lazytrain.sft.data.sources import DataSource, fingerprint
from lightning_lazytrain.sft.data.tokenization import tokenize_records
from lightning_lazytrain.sft.data.tokenizer import load_model_tokenizer, load_tokenizer

DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "metamath", "custom"]


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


class SFTDataModule(pl.LightningDataModule):
    """SFT data for ``CausalLMModule``: chat, instruction, completion or plain-text rows (docs/recipes.md).

    Args:
        data_path: a .jsonl/.json/.parquet/.csv file, a folder of them (a local hub download), ``hf:NAME`` for
            ``datasets.load_dataset(NAME)`` (``data_split``, ``data_revision``, ``data_cache_dir``), or ``"demo"`` /
            ``"demo_chat"`` (the shipped sets).
        tokenizer: tokenizer name or path; ``None`` takes the model's own (``model.pretrained``) when it names one,
            else the offline Qwen tokenizer.
        data_format: ``"auto"`` detects it from the first row; or ``"messages"``, ``"sharegpt"``, ``"alpaca"``,
            ``"prompt_completion"``, ``"text"`` (loss on every token), ``"metamath"``/``"custom"``
            (``prompt_key``/``response_key``/``input_key``).
        assistant_turns: ``"all"`` trains every assistant turn of a conversation, ``"last"`` only the last one.
        max_seq_length: tokens per sample after the chat template; longer samples lose their tail, and samples with
            no trained token left are dropped (counted in ``skipped``, with a warning).
        val_fraction: held-out share (the paper's 70/30 split is 0.3), split by a seeded shuffle.
        max_samples: keep only this many records (taken from the shuffled order, before the split).
        packing: pack several training samples per row, each attending only to itself (validation is not packed).
        max_eval_samples: cap on held-out samples the validation loop sees (generation is slow); ``None`` = all.
        cache_tokenized / cache_dir: keep tokenized sets on disk (default folder: ``$LAZYTRAIN_CACHE`` or
            ``~/.cache/lightning_lazytrain``), keyed by data, tokenizer, template and settings.
        num_proc: processes that tokenize a large set. ``show_sample``: log one sample with its loss mask.

    Bad arguments raise :class:`DataSettingError` here; bad or missing data raise another :class:`DataError` at
    ``setup``, as does a set with no trainable sample left (or no held-out one when ``val_fraction > 0``).
    """

    def __init__(
        self,
        data_path: str = DEMO_DATA,
        tokenizer: str | None = None,
        data_format: DataFormat = "auto",
        prompt_key: str = "query",
        response_key: str = "response",
        input_key: str | None = None,
        system_prompt: str | None = None,
        assistant_turns: Literal["all", "last"] = "all",
        data_split: str = "train",
        data_revision: str | None = None,
        data_cache_dir: str | None = None,
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
        num_proc: int = 1,
        cache_tokenized: bool = True,
        cache_dir: str | None = None,
        show_sample: bool = True,
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
            model = self.trainer.lightning_module if self.trainer is not None else None
            hp: Any = getattr(model, "hparams", {}) if self.hparams.tokenizer is None else {}
            if hp.get("pretrained"):
                self._tokenizer = load_model_tokenizer(hp)
            else:
                self._tokenizer = load_tokenizer(self.hparams.tokenizer)
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tok: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tok

    def _source(self) -> DataSource:
        hp = self.hparams
        return DataSource(self.data_path, hp.data_split, hp.data_revision, hp.data_cache_dir)

    def _tokenize(self, records: list[Record], indices: list[int], keys: dict[str, str]) -> tuple[list[Example], int]:
        hp = self.hparams
        picked = [records[i] for i in indices]
        if not hp.cache_tokenized:
            return tokenize_records(
                self.tokenizer, picked, hp.max_seq_length, hp.system_prompt, hp.assistant_turns, hp.num_proc
            )
        if not keys:  # once per setup: digesting the data and the tokenizer costs a pass over each
            keys.update(data=fingerprint(self._source()), tokenizer=tokenizer_fingerprint(self.tokenizer))
        settings = {
            name: hp[name]
            for name in (
                "data_format",
                "prompt_key",
                "response_key",
                "input_key",
                "system_prompt",
                "assistant_turns",
                "max_seq_length",
            )
        }
        key = cache_key(keys["data"], keys["tokenizer"], settings, indices)
        folder = Path(hp.cache_dir).expanduser() if hp.cache_dir else default_cache_dir()
        cached = load_cached(folder, key)
        if cached is not None:
            return cached
        examples, skipped = tokenize_records(
            self.tokenizer, picked, hp.max_seq_length, hp.system_prompt, hp.assistant_turns, hp.num_proc
        )
        save_cached(folder, key, examples, skipped)
        return examples, skipped

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return  # fit then validate/test in one process: tokenize once
        hp = self.hparams
        records = read_records(self._source(), self.fields, hp.data_format)
        train_idx, val_idx = split_indices(len(records), hp.val_fraction, hp.seed)
        if hp.max_samples is not None:
            # cap each side in proportion so the split itself does not move when the cap changes
            n_val = round(hp.max_samples * hp.val_fraction)
            train_idx, val_idx = train_idx[: hp.max_samples - n_val], val_idx[:n_val]
        if hp.max_eval_samples is not None:
            val_idx = val_idx[: hp.max_eval_samples]
        keys: dict[str, str] = {}
        train, skip_t = self._tokenize(records, train_idx, keys)
        val, skip_v = self._tokenize(records, val_idx, keys)
        self.skipped = skip_t + skip_v
        if self.skipped:
            warnings.warn(
                f"{self.data_path}: skipped {self.skipped} of {len(train_idx) + len(val_idx)} samples whose prompt "
                f"fills max_seq_length={hp.max_seq_length} (no response token would be trained on)",
                stacklevel=2,
            )
        self._check_left(len(records), train_idx, val_idx, train, val)
        if hp.show_sample:
            rank_zero_info(describe_sample(self.tokenizer, train[0]))
        self.train_set = SFTDataset(pack_examples(train, hp.max_seq_length) if hp.packing else train)
        self.val_set = SFTDataset(val)

    def _check_left(
        self, n_records: int, train_idx: list[int], val_idx: list[int], train: list[Example], val: list[Example]
    ) -> None:
        hp = self.hparams
        if not train_idx:
            raise EmptyDataError(
                f"no training sample: max_samples={hp.max_samples} at val_fraction={hp.val_fraction}"
                " leaves none for training",
                "Raise max_samples or lower val_fraction",
                source=self.data_path,
            )
        if not train:
            raise EmptyDataError(
                f"no training sample left: all {len(train_idx)} have a prompt that fills max_seq_length="
                f"{hp.max_seq_length} tokens with the chat template, so no response token would be trained on",
                "Raise max_seq_length or shorten the prompts",
                source=self.data_path,
            )
        if not val and hp.val_fraction > 0 and hp.max_eval_samples != 0:
            if val_idx:
                why = f"all {len(val_idx)} have a prompt that fills max_seq_length={hp.max_seq_length}"
            else:
                why = f"val_fraction={hp.val_fraction} of {n_records} records (max_samples={hp.max_samples}) is none"
            raise EmptyDataError(
                f"no held-out sample left: {why}",
                "Raise max_seq_length / max_samples, or set val_fraction=0 to train without validation",
                source=self.data_path,
            )

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def train_dataloader(self) -> DataLoader:
        collate = SFTCollator(self._pad_id(), pad_to_multiple_of=self.hparams.pad_to_multiple_of)
        # same sample order for the same seed; its place mid-epoch is saved in checkpoints, so a resume continues it
        sampler = ResumableRandomSampler(self.train_set, seed=self.hparams.seed)
        return ResumableDataLoader(
            self.train_set,
            batch_size=self.hparams.batch_size,
            sampler=sampler,
            collate_fn=collate,
            num_workers=self.hparams.num_workers,
        )

    def _eval_loader(self) -> DataLoader:
        collate = SFTCollator(self._pad_id(), generation=True, pad_to_multiple_of=self.hparams.pad_to_multiple_of)
        return DataLoader(
            self.val_set,
            batch_size=self.hparams.eval_batch_size or self.hparams.batch_size,
            shuffle=False,
            collate_fn=collate,
            num_workers=self.hparams.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader()
