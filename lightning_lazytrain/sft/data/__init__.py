"""SFT data: sources, row formats, chat templates and loss masks, the tokenized cache, packing, the datamodule."""

from lightning_lazytrain.sft.data.answers import answers_match, extract_answer, normalize_answer
from lightning_lazytrain.sft.data.collate import SFTCollator, model_inputs
from lightning_lazytrain.sft.data.errors import (
    DataError,
    DataFormatError,
    DataPathError,
    DataSettingError,
    EmptyDataError,
)
from lightning_lazytrain.sft.data.examples import IGNORE_INDEX, Example
from lightning_lazytrain.sft.data.formats import FieldMap, Record, read_records
from lightning_lazytrain.sft.data.packing import pack_examples
from lightning_lazytrain.sft.data.sft import SFTDataModule, split_indices
from lightning_lazytrain.sft.data.sources import DataSource
from lightning_lazytrain.sft.data.tokenization import tokenize_records
from lightning_lazytrain.sft.data.tokenizer import load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "DataError",
    "DataFormatError",
    "DataPathError",
    "DataSettingError",
    "DataSource",
    "EmptyDataError",
    "Example",
    "FieldMap",
    "Record",
    "SFTCollator",
    "SFTDataModule",
    "answers_match",
    "extract_answer",
    "load_tokenizer",
    "model_inputs",
    "normalize_answer",
    "pack_examples",
    "read_records",
    "split_indices",
    "tokenize_records",
]
