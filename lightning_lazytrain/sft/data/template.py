"""Chat-template rendering and which characters of it are trained on (the assistant turns).

Labels come from the rendered text itself, so they follow whatever the model's template writes (Qwen's ChatML,
Llama 3's headers, a think block): the conversation is rendered, each turn's content is located in it, and an
assistant span runs from its content to the end of the template's turn closer (``<|im_end|>\\n``, ``<|eot_id|>``),
which the model must learn to emit. Token labels then follow from the tokenizer's character offsets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from lightning_lazytrain.sft.data.errors import DataFormatError
from lightning_lazytrain.sft.data.formats import Record

# template variables some families read (Qwen3: no think block to generate, the same one training renders)
TEMPLATE_KWARGS = {"enable_thinking": False}
_PROBE = "LAZYTRAIN-PROBE-7f3a"
_PLACEHOLDER = re.compile("\x00LZT(\\d+)\x00")


def render_chat(tok: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], generation: bool = False) -> str:
    """``messages`` through the tokenizer's chat template (``generation``: with the assistant turn opened)."""
    return tok.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation, **TEMPLATE_KWARGS)


def turn_closer(tok: PreTrainedTokenizerBase) -> str:
    """What the template writes after an assistant turn's content (end-of-turn token and separator)."""
    probe = render_chat(tok, [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}])
    return probe[probe.rindex(_PROBE) + len(_PROBE) :]


def with_system(record: Record, system_prompt: str | None) -> list[dict[str, str]]:
    """The record's messages, with ``system_prompt`` first when it has no system turn of its own."""
    messages = record.chat()
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def generation_prompt(tok: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> str:
    """The conversation before its last assistant turn, with the assistant turn opened: what serving sends."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return render_chat(tok, messages[:last], generation=True)


def _placed(rendered: str, contents: Sequence[str]) -> tuple[str, list[tuple[int, int]]] | None:
    """``rendered`` with each placeholder replaced by its content, and where each content landed; ``None`` when a
    placeholder is missing or repeated (the template did more than insert the content)."""
    pieces = _PLACEHOLDER.split(rendered)
    found = [int(i) for i in pieces[1::2]]
    if sorted(found) != list(range(len(contents))):
        return None
    text, spans, pos = [], [(0, 0)] * len(contents), 0
    for j, piece in enumerate(pieces):
        if j % 2:
            piece = contents[int(piece)]
            spans[found[j // 2]] = (pos, pos + len(piece))
        text.append(piece)
        pos += len(piece)
    return "".join(text), spans


def assistant_spans(
    tok: PreTrainedTokenizerBase,
    record: Record,
    messages: Sequence[dict[str, str]],
    closer: str,
    last_only: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered conversation, character spans trained on: each assistant turn, or only the last).

    Each turn's place comes from rendering the conversation with a placeholder for every content and checking that
    putting the contents back (as written, or trimmed as Llama 3's template does) gives the real rendering.
    ``closer`` is :func:`turn_closer` of ``tok`` (computed once per data set).
    """
    text = render_chat(tok, messages)
    marked = render_chat(tok, [{**m, "content": f"\x00LZT{i}\x00"} for i, m in enumerate(messages)])
    for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
        placed = _placed(marked, contents)
        if placed is not None and placed[0] == text:
            break
    else:
        raise DataFormatError(
            record.source,
            record.line,
            "messages",
            "the chat template rewrites the turns' text, so the assistant tokens cannot be found "
            "in the rendered conversation",
            "Use a tokenizer whose template keeps the turns' text",
        )
    spans = []
    for m, (start, end) in zip(messages, placed[1], strict=True):
        if m["role"] == "assistant":
            spans.append((start, end + len(closer) if text.startswith(closer, end) else end))
    return text, spans[-1:] if last_only else spans
