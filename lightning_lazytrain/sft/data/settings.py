"""Checks of ``SFTDataModule``'s arguments, cheap enough to run before a model is loaded (the CLI does).

Each failure is a :class:`DataSettingError` naming the argument, so a typo costs seconds, not a model load.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_lazytrain.sft.data.demo_chat import DEMO_CHAT_PATH
from lightning_lazytrain.sft.data.demo_math import DEMO_MATH_PATH
from lightning_lazytrain.sft.data.errors import DataSettingError
from lightning_lazytrain.sft.data.formats import FieldMap
from lightning_lazytrain.sft.data.sources import data_files, is_dataset_name

#: ``data_path`` value that selects the shipped demo arithmetic set
DEMO_DATA = "demo"
#: ``data_path`` value that selects the shipped chat-format (``messages``) set
DEMO_CHAT_DATA = "demo_chat"
_SHIPPED = {DEMO_DATA: DEMO_MATH_PATH, DEMO_CHAT_DATA: DEMO_CHAT_PATH}

# (argument, smallest allowed value, whether None is allowed, why the bound)
_AT_LEAST: tuple[tuple[str, int, bool, str], ...] = (
    ("max_seq_length", 2, False, "a sample needs at least one prompt and one response token"),
    ("batch_size", 1, False, "a batch holds at least one sample"),
    ("eval_batch_size", 1, True, "a batch holds at least one sample (null: batch_size)"),
    ("max_samples", 1, True, "null keeps every record"),
    ("max_eval_samples", 0, True, "0 turns validation off, null keeps every held-out sample"),
    ("pad_to_multiple_of", 1, True, "null pads to the longest sample"),
    ("num_workers", 0, False, "0 loads in the main process"),
    ("num_proc", 1, False, "1 tokenizes in the main process"),
)


def resolve_data_path(data_path: str) -> Path:
    """The file or folder behind ``data_path`` (``"demo"``/``"demo_chat"``: a shipped set), ``~`` expanded."""
    return _SHIPPED[data_path] if data_path in _SHIPPED else Path(data_path).expanduser()


def check_settings(settings: Mapping[str, Any], check_path: bool = False) -> None:
    """Raise :class:`DataSettingError` (or :class:`DataPathError` with ``check_path``) for a bad argument.

    ``settings`` holds ``SFTDataModule`` arguments by name; missing ones are skipped (their defaults are valid).
    """
    for name, low, nullable, why in _AT_LEAST:
        if name not in settings:
            continue
        value = settings[name]
        if value is None and nullable:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise DataSettingError(name, f"got {value!r}", f"Use an integer >= {low} ({why})")
    fraction = settings.get("val_fraction", 0.0)
    if not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not 0.0 <= fraction < 1.0:
        raise DataSettingError("val_fraction", f"got {fraction!r}",
                               "Use a number in [0, 1): the held-out share (0.3 = the paper's 70/30 split)")
    if "data_format" in settings:
        FieldMap.for_format(settings["data_format"])
    turns = settings.get("assistant_turns", "all")
    if turns not in ("all", "last"):
        raise DataSettingError("assistant_turns", f"got {turns!r}",
                               "Use 'all' (train every assistant turn) or 'last' (only the last one)")
    if check_path and "data_path" in settings:
        path = str(settings["data_path"])
        if not is_dataset_name(path):  # a hub dataset is checked when it is loaded
            data_files(resolve_data_path(path), str(settings.get("data_split") or "train"))
