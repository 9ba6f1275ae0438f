"""Loading a tokenizer directory the way it was saved.

`transformers` v5's `AutoTokenizer` builds the tokenizer class of the model type named by a
`config.json` next to the tokenizer (a Qwen2 model dir gives `Qwen2Tokenizer`, with Qwen's
byte-level pre-tokenizer) even when `tokenizer_config.json` says the tokenizer is a plain
`tokenizers` pipeline, which silently re-tokenizes text. A directory whose
`tokenizer_config.json` names the generic class is therefore loaded with
`PreTrainedTokenizerFast`, which keeps `tokenizer.json` exactly; everything else goes through
`AutoTokenizer` as usual.
"""

from __future__ import annotations

import json
import os

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
    cfg_file = os.path.join(path, "tokenizer_config.json")
    cls = None
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            cls = json.load(f).get("tokenizer_class")
    if cls in GENERIC_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
