"""Prompt data: verl-format datasets and the PPO prompt loader.

`data.demo` (the built-in addition task and its tokenizer) and `data.gsm8k` (the GSM8K
converter) are command-line modules too, so they are imported by their own names and
not re-exported here (re-exporting them would make `python -m data.demo` warn).
"""

from data.dataset import (
    DatasetError,
    PromptDataLoader,
    RLHFDataset,
    read_records,
    write_jsonl,
    write_records,
)

__all__ = [
    "DatasetError",
    "PromptDataLoader",
    "RLHFDataset",
    "read_records",
    "write_jsonl",
    "write_records",
]
