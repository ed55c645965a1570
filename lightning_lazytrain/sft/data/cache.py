"""The on-disk cache of tokenized sets, so a restart or a second run does not tokenize again.

The key covers everything the tokens depend on: the data's bytes (or a loaded dataset's fingerprint), the
tokenizer (its full serialized state and chat template), the settings (format, keys, system prompt, length,
trained turns, which records), and the source of the code that renders and tokenizes. A file is written under a
temporary name and renamed, so an interrupted run never leaves a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.examples import Example, examples_from_state, examples_to_state

#: environment variable naming the cache folder (default ``~/.cache/lightning_lazytrain``)
CACHE_ENV = "LAZYTRAIN_CACHE"
# the modules whose code decides the tokens: editing one of them makes every old entry stale
_CODE = ("formats.py", "template.py", "tokenization.py", "examples.py")


def default_cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, "~/.cache/lightning_lazytrain")).expanduser() / "sft-tokenized"


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    digest = hashlib.blake2b(digest_size=16)
    backend = getattr(tok, "backend_tokenizer", None)
    digest.update(backend.to_str().encode() if backend is not None else repr(sorted(tok.get_vocab().items())).encode())
    for part in (type(tok).__name__, tok.chat_template or "", tok.eos_token or "", tok.bos_token or ""):
        digest.update(str(part).encode() + b"\0")
    return digest.hexdigest()


def cache_key(data: str, tokenizer: str, settings: dict[str, Any], indices: Sequence[int]) -> str:
    digest = hashlib.blake2b(digest_size=20)
    here = Path(__file__).parent
    for name in _CODE:
        digest.update((here / name).read_bytes())
    digest.update(json.dumps({"data": data, "tokenizer": tokenizer, **settings}, sort_keys=True).encode())
    digest.update(torch.as_tensor(list(indices), dtype=torch.int64).numpy().tobytes())
    return digest.hexdigest()


def load_cached(folder: Path, key: str) -> tuple[list[Example], int] | None:
    """(examples, skipped) stored under ``key``, or ``None`` when there is no (readable) entry."""
    path = folder / f"{key}.pt"
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception:  # a cache file from an incompatible torch, or damaged: tokenize again and overwrite it
        return None
    return examples_from_state(state), int(state["skipped"])


def save_cached(folder: Path, key: str, examples: Sequence[Example], skipped: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.pt"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({**examples_to_state(examples), "skipped": skipped}, tmp)
    os.replace(tmp, path)
    return path
