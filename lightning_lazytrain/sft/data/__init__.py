"""SFT data: tokenizer, record formats, the datamodule, answer extraction, the demo arithmetic set."""

from lightning_lazytrain.sft.data.answers import answers_match, extract_answer, normalize_answer
from lightning_lazytrain.sft.data.errors import (
    DataError,
    DataFormatError,
    DataPathError,
    DataSettingError,
    EmptyDataError,
)
from lightning_lazytrain.sft.data.formats import FieldMap, Record, read_records
from lightning_lazytrain.sft.data.sft import IGNORE_INDEX, Example, SFTCollator, SFTDataModule, split_indices
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "DataFormatError",
    "DataPathError",
    "DataSettingError",
    "EmptyDataError",
    "Example",
    "FieldMap",
    "Record",
    "SFTCollator",
    "SFTDataModule",
    "answers_match",
    "extract_answer",
    "load_tokenizer",
    "normalize_answer",
    "read_records",
    "split_indices",
]
