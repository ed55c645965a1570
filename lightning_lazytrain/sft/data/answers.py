"""MetaMathQA-style answer extraction and the normalisation used for exact match."""

from __future__ import annotations

import re

# MetaMathQA responses end with "The answer is: X"; take the last occurrence (a response may restate it)
_ANSWER_RE = re.compile(r"the answer is\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER_RE = re.compile(r"^[-+]?\d+(?:\.\d+)?$")


def extract_answer(text: str) -> str | None:
    """The text after the last "The answer is:", up to the end of its line; ``None`` if there is none."""
    matches = list(_ANSWER_RE.finditer(text))
    if not matches:
        return None
    return matches[-1].group(1).split("\n", 1)[0].strip()


def normalize_answer(answer: str) -> str:
    """Light normalisation: spaces, a trailing period, ``$``/``\\boxed{}`` wrappers, thousands commas, ``2.0 == 2``."""
    a = answer.strip()
    if a.startswith("\\boxed{") and a.endswith("}"):
        a = a[len("\\boxed{") : -1]
    a = a.strip().strip("$").strip().rstrip(".").strip()
    a = re.sub(r"\s+", "", a)
    if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", a):
        a = a.replace(",", "")
    if _NUMBER_RE.match(a):
        # compare numbers by value so "2.0", "2" and "+2" agree; keep text otherwise
        value = float(a)
        a = str(int(value)) if value.is_integer() else repr(value)
    return a


def answers_match(predicted_text: str, reference: str) -> bool:
    """Exact match of the answer extracted from a generated response against a reference answer."""
    got = extract_answer(predicted_text)
    if got is None:
        got = predicted_text  # free-form references (alpaca sets) are compared as whole responses
    return normalize_answer(got) == normalize_answer(reference)


def reference_answer(response: str) -> str:
    """The gold answer of a training response: its "The answer is:" part, or the whole response if it has none."""
    got = extract_answer(response)
    return got if got is not None else response.strip()
