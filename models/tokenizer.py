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
# the files any saved tokenizer directory has at least one of
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
NOT_JSON = "is not a readable JSON file"


def has_tokenizer(path) -> bool:
    """Whether directory `path` holds a tokenizer (one of `TOKENIZER_FILES`)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path: str, key: str | None = None):
    """The tokenizer of directory `path`. A damaged directory (a file that is not JSON, files that make
    no tokenizer) raises one `CheckpointFileError` naming the file (or the directory, when the files
    parse but do not make a tokenizer) and `key`, the config key `path` came from, when given. An
    ImportError (a package the tokenizer needs, such as sentencepiece, missing) is not a damaged
    file: it is raised as an ImportError naming the directory and the package."""
    from models.checkpoint import reading

    cfg_file = os.path.join(path, "tokenizer_config.json")
    cls = None
    if os.path.isfile(cfg_file):
        with reading(cfg_file, key, what=NOT_JSON):
            raw = json.loads(_read(cfg_file))
            cls = raw.get("tokenizer_class") if isinstance(raw, dict) else None
    try:
        if cls in GENERIC_CLASSES and os.path.isfile(os.path.join(path, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except ImportError as e:  # a package the tokenizer's class needs, not a damaged file
        _raise_missing_package(path, key, e)
    except Exception as e:  # what transformers and tokenizers raise for a bad file varies: said below
        _raise_unloadable(path, key, e)


def _raise_missing_package(path: str, key: str | None, error: ImportError):
    """An ImportError while loading the tokenizer in `path` (sentencepiece, tiktoken or protobuf not
    installed, or one that does not import), said as that, again as an ImportError with the
    original chained: its files may well be sound. The package is named where Python names the
    module (`ModuleNotFoundError.name`); transformers' own message names it otherwise."""
    from models.checkpoint import one_line

    where = f"{path!r}" + (f" ({key})" if key else "")
    package = error.name.split(".")[0] if error.name else None
    needs = f"the {package} package" if package else "a package"
    raise ImportError(f"loading the tokenizer in {where} needs {needs}, which is not installed or does not "
                      f"import ({one_line(error, limit=1000)})", name=error.name) from error


# the JSON files of a tokenizer directory, checked by name when transformers cannot load it
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")


def _read(file: str) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()


def _raise_unloadable(path: str, key: str | None, error: Exception):
    """Why transformers could not load the tokenizer in `path`, as one `CheckpointFileError`: the
    first of its JSON files that does not parse, named, or else the directory with `error` (what
    transformers and tokenizers raise for files that parse but make no tokenizer varies, down to a
    bare Exception from tokenizers' deserialisation)."""
    from models.checkpoint import CheckpointFileError, one_line, reading

    for name in _JSON_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with reading(file, key, what=NOT_JSON):
                json.loads(_read(file))
    where = f"{path!r}" + (f" ({key})" if key else "")
    raise CheckpointFileError(f"{where} holds tokenizer files that do not load ({one_line(error)})") from None


def decode_batch(tokenizer, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    """`tokenizer.batch_decode(sequences, skip_special_tokens=...)`, the same strings, faster.

    transformers v5's `batch_decode` walks every token id in Python (`to_py_obj`) and then decodes
    the sequences one by one; the `tokenizers` backend decodes a whole batch in one call, over
    all cores (256 responses of 256 tokens: 25 against 10 ms on two cores). The backend is used
    when that is all `batch_decode` would do: a fast tokenizer whose class keeps transformers'
    decoding methods and has no `clean_up_tokenization_spaces` post-processing; anything else
    goes through `batch_decode` itself."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    if not sequences:  # transformers 5.0's batch_decode gives [''] for no sequences
        return []
    cls = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and cls._decode is PreTrainedTokenizerFast._decode
             and cls.decode is PreTrainedTokenizerBase.decode and cls.batch_decode is PreTrainedTokenizerBase.batch_decode)
    if not plain or tokenizer.clean_up_tokenization_spaces:
        return tokenizer.batch_decode(sequences, skip_special_tokens=skip_special_tokens)
    return tokenizer.backend_tokenizer.decode_batch([list(s) for s in sequences], skip_special_tokens=skip_special_tokens)
