"""Prompt data: verl-format datasets and the PPO prompt loader.

`data.demo` (the built-in addition task and its tokenizer) and `data.gsm8k` (the GSM8K
converter) are command-line modules too, so they are imported by their own names and
not re-exported here (re-exporting them would make `python -m data.demo` warn).
"""

import importlib

_EXPORTS = {
    "data.dataset": ("DatasetError", "PromptDataLoader", "RLHFDataset", "read_records", "write_jsonl", "write_records"),
}

__all__ = [
    "DatasetError",
    "PromptDataLoader",
    "RLHFDataset",
    "read_records",
    "write_jsonl",
    "write_records",
]


def __getattr__(name: str):
    """PEP 562: a name of `__all__` is imported from its module on first use, so that importing one
    light module of `data` (or `data` itself) does not load the heavy ones."""
    for module, names in _EXPORTS.items():
        if name in names:
            value = globals()[name] = getattr(importlib.import_module(module), name)
            return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
