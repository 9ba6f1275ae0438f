"""Prompt datasets in verl's format, and the loader that batches them for PPO.

A row is one JSON object (a `.jsonl`/`.json` line or a `.parquet` row)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],      # or a plain string
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

`RLHFDataset` validates and tokenizes every row once, at construction, so that a bad
row fails before the first GPU minute is spent, with the file and row number in the
message; the trainer's ranks share the tokenizing (`across_ranks`). `PromptDataLoader` yields
lists of items in a seeded per-epoch order and can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import array
import bisect
import codecs
import hashlib
import json
import logging
import math
import os
import re
import sys
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
TOKENIZE_CHUNK = 2048  # prompts per batched tokenizer call while a dataset is built
# rows of a parquet file decoded at a time: Arrow's allocator keeps the buffers it frees for reuse, so
# a whole file decoded at once stayed in the process (100k GSM8K-shaped rows: ~300 MB a rank, all run)
PARQUET_BATCH_ROWS = 1024
# the rollout loops a row may name (`agent_name`, verl's): one generation, or `agent.loop`'s turns with tools
SINGLE_TURN_AGENT, TOOL_AGENT = "single_turn_agent", "tool_agent"
AGENT_NAMES = (SINGLE_TURN_AGENT, TOOL_AGENT)


class DatasetError(ValueError):
    """A dataset file or row cannot be used; the message names the file and row."""


def _load_pyarrow_parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DatasetError(
            "reading or writing .parquet files needs pyarrow: `pip install pyarrow` "
            "(or convert the data to .jsonl)"
        ) from err
    return pq


def _file_kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith(".jsonl") or lower.endswith(".json"):
        return "json"
    raise DatasetError(f"{path}: unsupported file type; expected .jsonl, .json or .parquet")


def read_records(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """Read a `.jsonl`/`.json` (one object per line), a `.json` holding one array of objects
    (as `datasets`, which verl reads files with, accepts) or a `.parquet` file.

    Returns `(row_number, row)` pairs with 1-based row numbers: the line number for
    JSON lines, the position in the array or the parquet file otherwise. Blank lines at the end of a JSON file are
    ignored; a blank line anywhere else, a malformed line, a value that is not an
    object or bytes that are not UTF-8 raise `DatasetError` naming `path:row`, and a
    `.parquet` file that pyarrow cannot read raises it naming the file.
    """
    path = os.fspath(path)
    if _checked_kind(path) == "parquet":
        return _parquet_records(path)
    if path.lower().endswith(".json") and _starts_with_bracket(path):
        return _parse_json_array(path)
    return parse_json_lines(path)


def _checked_kind(path: str) -> str:
    """`path`'s kind (`_file_kind`), once it is known to be a file."""
    if os.path.isdir(path):  # (whatever its name: verl's scripts take a dataset directory, meshppo its files)
        kind = "parquet" if path.lower().endswith(".parquet") else "dataset"
        raise DatasetError(f"{path}: a directory, not a dataset file; list its {kind} files (a directory of "
                           "parquet parts is several files)")
    kind = _file_kind(path)
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: dataset file not found")
    return kind


def _parquet_records(path: str, only: list[int] | None = None) -> list[tuple[int, dict[str, Any]]]:
    """A parquet file's `(row_number, row)` pairs, or with `only` (0-based positions, ascending) those
    rows alone: the others stay in Arrow's columns, never made Python objects. Decoded
    `PARQUET_BATCH_ROWS` rows at a time, and the memory Arrow freed meanwhile handed back after."""
    pq = _load_pyarrow_parquet()
    import pyarrow as pa

    numbers, rows, start = [], [], 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            end = start + batch.num_rows
            mine = range(start, end) if only is None else only[bisect.bisect_left(only, start):
                                                                  bisect.bisect_left(only, end)]
            if mine:
                picked = batch if only is None else batch.take(pa.array([i - start for i in mine], type=pa.int64()))
                rows += picked.to_pylist()
                numbers += [i + 1 for i in mine]
            start = end
    except (pa.ArrowException, OSError) as err:  # not parquet, truncated, or a damaged footer (OSError)
        raise DatasetError(f"{path}: not a readable parquet file: {err}") from err
    finally:
        pa.default_memory_pool().release_unused()
    return list(zip(numbers, rows))


def _parquet_num_rows(path: str) -> int:
    pq = _load_pyarrow_parquet()
    import pyarrow as pa

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(f"{path}: not a readable parquet file: {err}") from err


def chosen_records(files: list[str], max_samples: int, shuffle: bool, seed: int | None) -> list[tuple[str, dict]]:
    """`select_rows` of the rows of `files` in order, as `(FILE:ROW, row)` pairs. With a subset to draw, a
    parquet file's rows are counted from its metadata and only the chosen ones are made Python objects
    (50k of 500k rows: the rest stay in Arrow's columns)."""
    sizes, read = [], {}
    for path in files:
        if max_samples > 0 and _checked_kind(path) == "parquet":
            sizes.append(_parquet_num_rows(path))
        else:
            read[path] = read_records(path)
            sizes.append(len(read[path]))
    if not 0 < max_samples < sum(sizes):  # every row, in order (select_rows's rule)
        return [(f"{path}:{n}", row) for path in files for n, row in (read.get(path) or read_records(path))]
    picked = np.asarray(select_rows(range(sum(sizes)), max_samples, shuffle, seed), dtype=np.int64)
    starts = np.cumsum([0, *sizes])
    file_of = np.searchsorted(starts, picked, side="right") - 1
    local = picked - starts[file_of]
    rows: dict[tuple[int, int], tuple[int, dict]] = {}
    for f in np.unique(file_of).tolist():
        path, mine = files[f], sorted(set(local[file_of == f].tolist()))
        got = read[path] if path in read else _parquet_records(path, mine)
        by_position = dict(enumerate(got)) if path in read else {n - 1: (n, row) for n, row in got}
        rows.update({(f, i): by_position[i] for i in mine})
    return [(f"{files[f]}:{rows[f, i][0]}", rows[f, i][1]) for f, i in zip(file_of.tolist(), local.tolist())]


def _starts_with_bracket(path: str) -> bool:
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _parse_json_array(path: str) -> list[tuple[int, dict[str, Any]]]:
    """`(position, object)` for each element of a file holding one JSON array of rows."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        rows = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path}: not valid UTF-8 ({err.reason} at byte offset {err.start})") from err
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: malformed JSON array: {err.msg} at line {err.lineno} column {err.colno}") from err
    records = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{i}: expected a JSON object (array element {i}), got {type(row).__name__}")
        records.append((i, row))
    return records


def _json_lines(text: str) -> list[str]:
    """The lines of JSON-lines text: split at "\n", "\r\n" or a lone "\r" (old Mac files; JSON strings
    hold neither unescaped), not at what `str.splitlines` also splits at (U+2028, U+2029, U+0085, "\x0b",
    "\x0c", "\x1c".."\x1e"): a JSON string may hold those unescaped, as `json.dumps(ensure_ascii=False)`
    writes them. Text ending in a line break gives a last empty line."""
    return _LINE_BREAK.split(text)


_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def parse_json_lines(path: str, error: type[Exception] = DatasetError, skip_blank: bool = False,
                     drop_truncated_tail: bool = False) -> list[tuple[int, dict[str, Any]]]:
    """`(line_number, object)` for each line of a JSON-lines file (the one JSONL reader).

    Trailing blank lines are ignored. A blank line elsewhere is skipped with `skip_blank`, else
    an error; with `drop_truncated_tail` a malformed *last* line (a writer killed mid-line) is
    dropped with a warning. Other malformed lines, non-objects and bytes that are not UTF-8
    raise `error` naming `path:line`.
    """
    with open(path, "rb") as f:
        data = f.read()
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # as the JSON-array reader, and pyarrow
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as err:
        # The line as `_json_lines` below numbers it: the prefix before the bad byte is valid.
        lineno = len(_json_lines(data[bom:bom + err.start].decode("utf-8")))
        raise error(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte offset {bom + err.start})") from err
    lines = _json_lines(text)
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            if skip_blank:
                continue
            raise error(f"{path}:{lineno}: empty row (blank line)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if drop_truncated_tail and lineno == len(lines):
                print(f"warning: {path}:{lineno}: ignoring truncated last line", file=sys.stderr)
                break
            raise error(f"{path}:{lineno}: malformed JSON: {err.msg} at column {err.colno}") from err
        if not isinstance(row, dict):
            raise error(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        records.append((lineno, row))
    return records


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write rows as JSON lines (UTF-8, one object per line); returns the path."""
    path = os.fspath(path)
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_records(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write rows to `.jsonl`/`.json` (JSON lines) or `.parquet`, chosen by extension."""
    path = os.fspath(path)
    if _file_kind(path) == "json":
        return write_jsonl(rows, path)
    pq = _load_pyarrow_parquet()
    import pyarrow as pa

    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    rows = list(rows)
    inferred = pa.Table.from_pylist(rows).schema
    schema = pa.schema([pa.field(f.name, _in_row_order(pa, f.type, [r.get(f.name) for r in rows]), f.nullable)
                        for f in inferred])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def _in_row_order(pa, kind, values: list):
    """`kind` (an inferred Arrow type of `values`) with each struct's fields in the order the dicts give their keys,
    as datasets (verl's writer) and pyarrow from 24 on infer them; pyarrow before 24 sorts them by name."""
    if pa.types.is_struct(kind):
        names, dicts = {}, [v for v in values if isinstance(v, dict)]
        for d in dicts:
            names.update(dict.fromkeys(d))
        fields = [kind.field(i) for i in range(kind.num_fields)]
        by_name = {f.name: f for f in fields}
        order = [n for n in names if n in by_name] + [f.name for f in fields if f.name not in names]
        return pa.struct([pa.field(n, _in_row_order(pa, by_name[n].type, [d.get(n) for d in dicts]), by_name[n].nullable)
                          for n in order])
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        items = [x for v in values if isinstance(v, (list, tuple)) for x in v]
        inner = _in_row_order(pa, kind.value_type, items)
        return pa.large_list(inner) if pa.types.is_large_list(kind) else pa.list_(inner)
    return kind


# What a text-only model cannot read: a row that holds it is refused, not trained on without it.
MEDIA_PART_TYPES = ("image", "image_url", "video", "video_url", "audio", "input_audio")
TEXT_ONLY = ("meshppo's models are text-only (a multi-modal row would be trained on without its images, videos or "
             "audio)")


def _validate_messages(messages: list, where: str, prompt_key: str) -> None:
    """Refuse what no chat template can render, and a list none of whose messages has text (every content
    empty or whitespace; verl trains on those);
    everything else goes to the template as verl hands it on: `content` a string, a list of typed parts
    (`{"type": "text", "text": ...}`), or None on a message with `tool_calls`."""
    if not messages:
        raise DatasetError(f"{where}: field '{prompt_key}' is an empty message list")
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DatasetError(
                f"{where}: field '{prompt_key}' message {j} must be an object with 'role' and "
                f"'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if key not in message:
                raise DatasetError(f"{where}: field '{prompt_key}' message {j} has no '{key}'")
        if not isinstance(message["role"], str):
            raise DatasetError(f"{where}: field '{prompt_key}' message {j} 'role' must be a string, "
                               f"got {type(message['role']).__name__}")
        content = message["content"]
        if content is None and not message.get("tool_calls"):
            raise DatasetError(f"{where}: field '{prompt_key}' message {j} 'content' is null on a message without "
                               "'tool_calls'")
        if isinstance(content, list) and not all(isinstance(part, dict) for part in content):
            raise DatasetError(f"{where}: field '{prompt_key}' message {j} 'content' is a list whose items are not "
                               "all objects (typed parts such as {\"type\": \"text\", \"text\": ...})")
        if not isinstance(content, (str, list, type(None))):
            raise DatasetError(f"{where}: field '{prompt_key}' message {j} 'content' must be a string, a list of "
                               f"typed parts or null, got {type(content).__name__}")
        parts = content if isinstance(content, list) else []
        for i, part in enumerate(parts):
            if part.get("type", "text") == "text" and "text" in part and not isinstance(part["text"], str):
                raise DatasetError(f"{where}: field '{prompt_key}' message {j} part {i} of type 'text' has a 'text' "
                                   f"that is not a string: {type(part['text']).__name__}")
        media = [part["type"] for part in parts if part.get("type") in MEDIA_PART_TYPES]
        if media:
            raise DatasetError(f"{where}: field '{prompt_key}' message {j} has a part of type {media[0]!r}: "
                               f"{TEXT_ONLY}")
    # What the template would render without any message's text is no task: refused, not trained on. (Which
    # role carries the task is the data's choice: a system-only prompt, or a "human" role a template renders.)
    if not any(_content_text(message["content"]).strip() for message in messages):
        raise DatasetError(f"{where}: field '{prompt_key}' has no text in any of its {len(messages)} message"
                           f"{'s' if len(messages) > 1 else ''} (empty or whitespace only)")


def _content_text(content: str | list | None) -> str:
    """A message's text without a template: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type", "text") == "text")


def _is_encoded_messages(text: str) -> bool:
    """Whether a string prompt is a JSON-encoded list of chat messages (a list stored as its JSON text)."""
    if not text.lstrip().startswith("["):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


# `apply_chat_template`'s arguments that a prompt's rendering sets itself (the chat, the generation prompt, text
# out, the tool config's schemas): chat template kwargs that set them again are refused, as verl 0.9.1's renderer
# fails on them at its first rollout (a keyword given twice)
RENDERING_ARGS = ("conversation", "add_generation_prompt", "continue_final_message", "tokenize", "tools")


def check_chat_template_kwargs(kwargs: dict[str, Any], key: str) -> None:
    """ValueError naming `key` (the option that holds `kwargs`) when the chat template's extra keyword arguments
    set one of `RENDERING_ARGS`, which every prompt's rendering sets itself."""
    clash = [name for name in RENDERING_ARGS if name in kwargs]
    if clash:
        raise ValueError(f"{key} sets {', '.join(clash)}: the rendering of a prompt sets "
                         f"{'that' if len(clash) == 1 else 'those'} itself (the row's messages, the generation prompt, "
                         "text out to tokenize, and a tool_agent row's tools from actor_rollout_ref.rollout.multi_turn."
                         f"tool_config_path); remove {'it' if len(clash) == 1 else 'them'}")


def render_prompt(tokenizer, prompt: Any, where: str, key: str = "prompt", apply_chat_template: bool = True,
                  no_template_option: str = "apply_chat_template=False",
                  chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, bool]:
    """The text of a prompt field and whether a chat template rendered it (then it already holds the special
    tokens: tokenize it with `add_special_tokens=False`).

    A string is the text as it is; a list of chat messages `{"role", "content"}` is rendered with the
    tokenizer's chat template and the generation prompt (and `chat_template_kwargs`, verl's
    `data.apply_chat_template_kwargs`, e.g. `enable_thinking`), or, with `apply_chat_template` False, its
    contents joined by newlines. A string holding a JSON-encoded message list is refused, as verl refuses it,
    rather than tokenized as raw JSON, and so is a string that is empty or whitespace only. Any problem is a
    `DatasetError` naming `where` and `key`; `no_template_option` is the switch the message suggests when the
    tokenizer has no chat template.
    """
    if isinstance(prompt, str):
        if _is_encoded_messages(prompt):
            raise DatasetError(f"{where}: field '{key}' is a JSON-encoded message list stored as a string; store "
                               "the list itself")
        if not prompt.strip():
            raise DatasetError(f"{where}: field '{key}' is an empty prompt (empty or whitespace only)")
        return prompt, False
    if not isinstance(prompt, list):
        raise DatasetError(f"{where}: field '{key}' must be a string or a list of chat messages, "
                           f"got {type(prompt).__name__}")
    _validate_messages(prompt, where, key)
    if not apply_chat_template:
        return "\n".join(_content_text(m["content"]) for m in prompt), False
    # a template given in the kwargs (verl passes them to apply_chat_template) serves as well as the tokenizer's
    if tokenizer is None or not (getattr(tokenizer, "chat_template", None)
                                 or (chat_template_kwargs or {}).get("chat_template")):
        raise DatasetError(f"{where}: field '{key}' is a list of chat messages but the tokenizer has no chat "
                           f"template; use text prompts, set {no_template_option}, or use a tokenizer with a "
                           "`chat_template`")
    try:
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False,
                                             **(chat_template_kwargs or {}))
    except Exception as err:
        raise DatasetError(f"{where}: the chat template failed on field '{key}': {err}") from err
    return text, True


def _ground_truth(row: dict[str, Any], where: str, required: bool) -> Any:
    """`reward_model.ground_truth` as stored (any JSON or Arrow value: verl hands it to the reward
    function unconverted; None for a row without one). Where `required` (the built-in scorers read
    it), a row without one fails here, at load, and not at the first reward."""
    reward_model = row.get("reward_model")
    if reward_model is not None and not isinstance(reward_model, dict):
        raise DatasetError(
            f"{where}: field 'reward_model' must be an object, got {type(reward_model).__name__}"
        )
    value = None if reward_model is None else reward_model.get("ground_truth")
    if value is None and required:
        raise DatasetError(f"{where}: missing field 'reward_model.ground_truth': the built-in scorer compares "
                           "each response with it; add it, score with a custom reward function "
                           "(custom_reward_function.path; it gets None), or let a reward model score alone "
                           "(reward_model.enable=true)")
    return value


def select_rows(records: list, max_samples: int, shuffle: bool, seed: int | None) -> list:
    """The `max_samples` of `records` verl's `RLHFDataset` keeps (all when `max_samples` is -1, 0 or at least
    their number): with `shuffle`, `numpy.random.default_rng(seed).choice(len, max_samples, replace=False)`
    in the order drawn, else the first `max_samples`. An unseeded draw would differ between ranks, so
    `seed` None with `shuffle` is refused."""
    if not 0 < max_samples < len(records):
        return records
    if not shuffle:
        return records[:max_samples]
    if seed is None:
        raise ValueError("choosing max_samples rows at random needs a seed (every rank must choose the same rows)")
    indices = np.random.default_rng(seed).choice(len(records), size=max_samples, replace=False)
    return [records[i] for i in indices.tolist()]


def _truncate(ids: Sequence[int], limit: int, mode: str) -> Sequence[int]:
    """`ids` cut to `limit` tokens as verl's dataset cuts them (`mode` left, right or middle)."""
    if mode == "left":
        return ids[-limit:]
    if mode == "right":
        return ids[:limit]
    return ids[:limit // 2] + ids[-(limit - limit // 2):]


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks of the default process group ((0, 1) without one)."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


class _Failure(NamedTuple):
    """What stopped a rank's share of a dataset's build: at the row `position` (the number of rows after
    the last one: the tokenizer), where `not_owner` says this rank does not render that row (its owner
    checks more of it, so the owner's error comes first), and the error."""

    position: int
    not_owner: bool
    error: Exception

    def shared(self) -> tuple[int, bool, bool, str]:
        """What the other ranks hear of it (it pickles): where, and whether a `DatasetError` says what."""
        dataset_error = isinstance(self.error, DatasetError)
        text = str(self.error) if dataset_error else f"{type(self.error).__name__}: {self.error}"
        return self.position, self.not_owner, dataset_error, text


def _records_digest(records: list[tuple[str, dict[str, Any]]]) -> tuple[int, str]:
    """The number of `records` and a digest of their rows' fields, in order (not of the files' paths, which
    may differ between ranks): what the ranks compare before each takes another's ids for its rows."""
    digest = hashlib.blake2b(digest_size=16)
    for _, row in records:
        digest.update(repr(row).encode() + b"\0")
    return len(records), digest.hexdigest()


def _ids_of_every_rank(mine, failure: _Failure | None, rank: int, world: int, records: tuple[int, str],
                       files: Sequence[str]) -> list:
    """Every rank's token ids (`mine`: this rank's rows' `Ragged`, None after a `failure`), in rank order,
    in one all-gather of flat arrays, the trainer's way of sharing host objects (`Samples`). The ranks
    must have read the same rows (`records`: `_records_digest`, compared first: a rank whose files hold
    other rows, a node's own copy that differs, would take ids of rows it does not have); else every
    rank raises the same `DatasetError` naming the files. Where some rank failed, every rank raises in
    it the error of the earliest row, as one process meets the rows: a `DatasetError` with the same
    message on every rank, naming the file and row."""
    if world == 1:
        if failure is not None:
            raise failure.error
        return [mine]
    every: list = [None] * world
    dist.all_gather_object(every, (mine, None if failure is None else failure.shared(), records))
    others = [r for r, (*_, theirs) in enumerate(every) if theirs != every[0][2]]
    if others:
        counts = "; ".join(f"rank {r}: {every[r][2][0]} rows" for r in [0, *others[:3]])
        raise DatasetError(f"{', '.join(map(str, files))}: ranks {others} read other rows than rank 0 ({counts}): "
                           "every rank must read the same data (the same files, the same content on every node)")
    failed = [(shared, r) for r, (_, shared, _) in enumerate(every) if shared is not None]
    if failed:
        (_, _, dataset_error, text), first = min(failed)
        if first == rank:
            raise failure.error
        raise DatasetError(text) if dataset_error else RuntimeError(f"(on rank {first}, building the dataset) {text}")
    return [ids for ids, *_ in every]


def _row_ids(ids, i: int) -> array.array:
    """Row `i` of `ids` (a `Ragged` of int32) as the int32 array an item keeps (4 bytes a token, where a list of
    Python ints costs 36 above id 256)."""
    return array.array("i", ids.flat[ids.offsets[i]:ids.offsets[i + 1]].tobytes())


class RLHFDataset:
    """Prompts for RL, read from local files in verl's row format and tokenized once.

    Args:
        files: one path or a list of paths (`.jsonl`, `.json` with one object per line,
            `.parquet`); rows are concatenated in order.
        tokenizer: a Hugging Face tokenizer.
        prompt_key: the row field holding the prompt: a string (tokenized as is, with the
            tokenizer's own special tokens such as a Llama BOS) or a list of chat messages
            `{"role", "content"}` (rendered with the tokenizer's chat template and the
            generation prompt, then tokenized without adding special tokens, because the
            template already contains them).
        max_prompt_length: longest prompt in tokens.
        filter_overlong_prompts: drop longer prompts (counted in `num_filtered`) instead of
            applying `truncation`.
        truncation: for overlong prompts that are not filtered: `"error"` raises, `"left"`
            keeps the last `max_prompt_length` tokens, `"right"` the first, `"middle"` the
            first `max_prompt_length // 2` and the last `max_prompt_length - max_prompt_length // 2`
            (verl's modes).
        apply_chat_template: when False, chat prompts are not templated: the message
            contents are joined with newlines and tokenized as text (for base models
            without a chat template).
        apply_chat_template_kwargs: extra keyword arguments of `apply_chat_template`
            (verl's, e.g. `{"enable_thinking": False}`).
        require_ground_truth: every row must carry `reward_model.ground_truth` (on for the
            built-in scorers; a custom reward function gets None for a row without one, as
            verl's managers pass it, and a reward model alone reads none).
        data_sources: the `data_source` values a row may name (the built-in scorers' when
            they give the rewards), so that a row no scorer knows fails at load, as does one whose
            ground truth its scorer would never match (`builtin_ground_truth_problem`: a number
            for GSM8K's string comparison); None: any.
        media_keys: the fields of a row's images, videos and audio (verl's `data.image_key`,
            `video_key` and `audio_key`): a row with any, or with a media part in a message, is
            refused (the models are text-only).
        chat_prompts_for: why every prompt must be a list of chat messages (something renders
            the chat again, e.g. a reward model's template), so that a text prompt fails at
            load saying so; None: text prompts are fine.
        default_agent: the rollout loop of rows without an `agent_name` field (verl's
            `rollout.agent.default_agent_loop`): `single_turn_agent` or `tool_agent`
            (`agent.loop`: multi-turn with tool calls, which needs chat-message prompts).
        tool_schemas: the tools' OpenAI function schemas, given to the chat template
            (`tools=`) when it renders a `tool_agent` row's prompt, as verl's tool agent renders it:
            those of the row's `extra_info.tool_selection` (verl 0.9.1's per-row choice of tools,
            in its order) when it names some, all of them otherwise.
        max_samples, shuffle, seed: keep only `max_samples` rows of all the files (-1 or 0:
            all) before anything else, chosen as verl's dataset chooses them (`select_rows`).
        across_ranks: every rank of the default process group builds this dataset at once (the
            trainer's ranks): each renders and tokenizes only its share of the prompts, rows
            rank::world_size, and the ranks all-gather the ids. The items, the rows filtered and the
            errors are the same as one process's. Without a process group: one process's build.

    Items (`dataset[i]`) are dicts with `input_ids` (of the prompt's text, which is not kept), `raw_prompt`,
    `data_source`, `ground_truth` (the stored value, unconverted; None only without
    `require_ground_truth`), `extra_info` (dict), `agent_name`, `tools_kwargs` (the row's
    `extra_info.tools_kwargs`, verl's per-tool `create_kwargs`; `{}` when absent), `tool_selection`
    (a `tool_agent` row's `extra_info.tool_selection`, the names of the tools it gets, each once; None
    for all the tools, and for other rows, whose loop never reads it, as verl's single-turn loop) and
    `index` (the item's position in this dataset).
    """

    def __init__(
        self,
        files: list[str] | str,
        tokenizer,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        apply_chat_template: bool = True,
        apply_chat_template_kwargs: dict[str, Any] | None = None,
        require_ground_truth: bool = True,
        data_sources: Collection[str] | None = None,
        chat_prompts_for: str | None = None,
        media_keys: Collection[str] = ("images", "videos", "audios"),
        default_agent: str = SINGLE_TURN_AGENT,
        tool_schemas: list[dict] | None = None,
        max_samples: int = -1,
        shuffle: bool = False,
        seed: int | None = None,
        across_ranks: bool = False,
    ) -> None:
        if default_agent not in AGENT_NAMES:
            raise ValueError(f"default_agent must be one of {list(AGENT_NAMES)}, got {default_agent!r}")
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {list(TRUNCATION_MODES)}, got {truncation!r}")
        if not isinstance(max_prompt_length, int) or max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be a positive integer, got {max_prompt_length!r}")
        check_chat_template_kwargs(apply_chat_template_kwargs or {}, "apply_chat_template_kwargs")
        if isinstance(files, (str, os.PathLike)):
            files = [files]
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise DatasetError("no dataset files given")
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.apply_chat_template = apply_chat_template
        self.apply_chat_template_kwargs = dict(apply_chat_template_kwargs or {})
        self.require_ground_truth = require_ground_truth
        self.data_sources = None if data_sources is None else sorted(data_sources)
        self.chat_prompts_for = chat_prompts_for
        self.media_keys = tuple(media_keys)
        self.default_agent = default_agent
        self.tool_schemas = list(tool_schemas or [])
        self._schemas_by_name = {schema["function"]["name"]: schema for schema in self.tool_schemas}
        self.across_ranks = across_ranks
        self.num_filtered = 0
        self._items: list[dict[str, Any]] = []
        self._load(chosen_records(self.files, max_samples, shuffle, seed))
        self.fingerprint = self._fingerprint()
        if self.num_filtered:
            logger.warning(
                "filtered %d prompt(s) longer than max_prompt_length=%d tokens from %s",
                self.num_filtered, max_prompt_length, ", ".join(self.files),
            )
        if not self._items:
            detail = (
                f" ({self.num_filtered} row(s) filtered as longer than max_prompt_length="
                f"{max_prompt_length}; raise it or set filter_overlong_prompts=False)"
                if self.num_filtered else ""
            )
            raise DatasetError(f"{', '.join(self.files)}: dataset is empty{detail}")

    def _prompt_text(self, prompt: Any, where: str, agent: str, tool_selection: list[str] | None) -> tuple[str, bool]:
        """Returns the prompt's text and whether it came from a chat template."""
        from agent.tools import select_tools  # here: agent.tools imports rewards, whose scorers import data

        kwargs = self.apply_chat_template_kwargs
        if agent == TOOL_AGENT:
            if not isinstance(prompt, list) or not self.apply_chat_template:
                raise DatasetError(f"{where}: agent_name {TOOL_AGENT} renders the tool responses with the chat "
                                   f"template, so field '{self.prompt_key}' must be chat messages and "
                                   "data.apply_chat_template true")
            if self.tool_schemas:
                kwargs = {**kwargs, "tools": list(select_tools(self._schemas_by_name, tool_selection).values())}
        return render_prompt(self.tokenizer, prompt, where, self.prompt_key, self.apply_chat_template,
                             "data.apply_chat_template=False", kwargs)

    def _agent(self, row: dict[str, Any], where: str) -> str:
        """The row's rollout loop: its `agent_name`, or the default."""
        agent = row.get("agent_name")
        if agent is None:
            return self.default_agent
        if agent not in AGENT_NAMES:
            raise DatasetError(f"{where}: field 'agent_name' is {agent!r}; meshppo's loops are {list(AGENT_NAMES)}")
        return agent

    @staticmethod
    def _tools_kwargs(extra_info: dict[str, Any], where: str) -> dict[str, dict]:
        """verl's `extra_info.tools_kwargs`: per tool name, the arguments of its calls (`create_kwargs`).
        A tool whose value is None is left out: a parquet file whose rows name different tools has
        one struct of every row's tools, so each row reads None for the tools of the others."""
        tools_kwargs = extra_info.get("tools_kwargs")
        if tools_kwargs is None:
            return {}
        if isinstance(tools_kwargs, dict):
            tools_kwargs = {name: v for name, v in tools_kwargs.items() if v is not None}
        if not isinstance(tools_kwargs, dict) or not all(isinstance(v, dict) for v in tools_kwargs.values()):
            raise DatasetError(f"{where}: field 'extra_info.tools_kwargs' must map each tool's name to an object "
                               "(verl's {'create_kwargs': {...}})")
        return tools_kwargs

    def _tool_selection(self, extra_info: dict[str, Any], agent: str, where: str) -> list[str] | None:
        """verl 0.9.1's `extra_info.tool_selection` of a tool_agent row: the names of the tools it gets
        (their schemas in its prompt, the only ones it may call), each once, in its order; None when
        absent or empty (all the tools, as in verl). Other rows: None, their loop never reads it."""
        from agent.tools import select_tools  # here: agent.tools imports rewards, whose scorers import data

        if agent != TOOL_AGENT:
            return None
        selection = extra_info.get("tool_selection")
        try:
            chosen = select_tools(self._schemas_by_name, selection)
        except ValueError as err:
            raise DatasetError(f"{where}: field 'extra_info.tool_selection' {err}") from None
        return list(chosen) if selection else None

    def count_agents(self) -> dict[str, int]:
        """How many items each rollout loop runs."""
        counts = dict.fromkeys(AGENT_NAMES, 0)
        for item in self._items:
            counts[item["agent_name"]] += 1
        return counts

    def _load(self, records: list[tuple[str, dict[str, Any]]]) -> None:
        """Validate and tokenize `(where, row)` records into items.

        With `across_ranks`, rank r of the process group renders and tokenizes rows r::world_size alone (the
        costly part of the build) and the ranks all-gather the ids; every rank checks every row's other fields
        (cheap), and a failure on any rank is raised on every rank (`_ids_of_every_rank`), so the items and the
        errors are those of one process."""
        rank, world = _rank_and_world() if self.across_ranks else (0, 1)
        fields, texts, mine, failure = [], [], None, None
        try:
            for position, (where, row) in enumerate(records):
                fields.append(self._checked_row(where, row, texts if position % world == rank else None))
            mine = self._tokenized(texts)
        except Exception as err:  # (told to the other ranks, which would otherwise wait for this one's ids)
            position = len(fields)  # the row that failed; len(records) after them all (the tokenizer)
            failure = _Failure(position, rank != position % world, err)
        digest = _records_digest(records) if world > 1 else (len(records), "")
        ids = _ids_of_every_rank(mine, failure, rank, world, digest, self.files)

        limit = self.max_prompt_length
        for position, (where, prompt, data_source, ground_truth, extra_info, agent, tools_kwargs,
                       tool_selection) in enumerate(fields):
            prompt_ids = _row_ids(ids[position % world], position // world)
            if not prompt_ids:
                raise DatasetError(f"{where}: field '{self.prompt_key}' tokenizes to no tokens (a tokenizer without a "
                                   "vocabulary for its text?)")
            if len(prompt_ids) > limit:
                if self.filter_overlong_prompts:
                    self.num_filtered += 1
                    continue
                if self.truncation == "error":
                    raise DatasetError(
                        f"{where}: prompt is {len(prompt_ids)} tokens, longer than max_prompt_length={limit}; "
                        "set filter_overlong_prompts=True or truncation='left'/'right'/'middle'"
                    )
                prompt_ids = _truncate(prompt_ids, limit, self.truncation)
            self._items.append({
                "input_ids": prompt_ids,
                "raw_prompt": prompt,
                "data_source": data_source,
                "ground_truth": ground_truth,
                "extra_info": extra_info,
                "agent_name": agent,
                "tools_kwargs": tools_kwargs,
                "tool_selection": tool_selection,
                "index": len(self._items),
                "where": where,  # FILE:ROW, for an error about the row found later
            })

    def _checked_row(self, where: str, row: dict[str, Any], texts: list[tuple[str, bool]] | None) -> tuple:
        """A row's fields as its item keeps them, each checked (a `DatasetError` naming `where` otherwise);
        with `texts` (the row is this rank's to tokenize) its prompt is rendered too, checked in its place
        among the others, and its text (`_prompt_text`) appended to `texts`."""
        from rewards.registry import builtin_ground_truth_problem  # the scorers' rule, where they give the rewards

        if not row:
            raise DatasetError(f"{where}: empty row")
        if self.prompt_key not in row or row[self.prompt_key] is None:
            raise DatasetError(f"{where}: missing field '{self.prompt_key}'")
        prompt = row[self.prompt_key]
        # as verl reads them (`row.get(key) or []`): empty or false is no media; a number or flag that is not is
        # refused as media too, naming the row, not failing as an object without a length
        media = [k for k in self.media_keys if row.get(k)]
        if media:
            raise DatasetError(f"{where}: field '{media[0]}' holds media: {TEXT_ONLY}")
        if self.chat_prompts_for is not None and not isinstance(prompt, list):
            raise DatasetError(f"{where}: field '{self.prompt_key}' is text, not a list of chat messages: "
                               f"{self.chat_prompts_for}")
        agent = self._agent(row, where)
        extra_info = row.get("extra_info")
        if extra_info is None:
            extra_info = {}
        elif not isinstance(extra_info, dict):
            raise DatasetError(
                f"{where}: field 'extra_info' must be an object, got {type(extra_info).__name__}"
            )
        tool_selection = self._tool_selection(extra_info, agent, where)  # the tools its prompt shows
        if texts is not None:
            texts.append(self._prompt_text(prompt, where, agent, tool_selection))
        data_source = row.get("data_source")
        if data_source is not None and not isinstance(data_source, str):
            raise DatasetError(
                f"{where}: field 'data_source' must be a string, got {type(data_source).__name__}"
            )
        if self.data_sources is not None and data_source not in self.data_sources:
            raise DatasetError(f"{where}: no built-in reward for data_source {data_source!r} (built-in: "
                               f"{self.data_sources}); set custom_reward_function.path to a Python file "
                               "defining compute_score(data_source, solution_str, ground_truth, extra_info=None)")
        ground_truth = _ground_truth(row, where, self.require_ground_truth)
        if self.data_sources is not None and ground_truth is not None:
            problem = builtin_ground_truth_problem(data_source, ground_truth)
            if problem:
                raise DatasetError(f"{where}: field 'reward_model.ground_truth' {problem}")
        tools_kwargs = self._tools_kwargs(extra_info, where)
        return where, prompt, data_source, ground_truth, extra_info, agent, tools_kwargs, tool_selection

    def _tokenized(self, texts: list[tuple[str, bool]]):
        """The ids of `texts` (`(text, templated)` pairs) in their order, as one `trainer.batching.Ragged` of
        int32 (the flat arrays the ranks share rollouts in; 4 bytes a token).

        Batched calls are much faster than a call per row with fast tokenizers; a chunk of rows at a
        time, as all of a large dataset's encodings alive at once held their memory after the build
        (100k prompts: 4.0 GB of RSS against 2.1 GB in chunks)."""
        from trainer.batching import Ragged  # the rollouts' flat rows, which every rank's ids travel in

        chunks, order = [], []
        for templated in (True, False):  # (a templated text holds its special tokens already)
            positions = [i for i, (_, t) in enumerate(texts) if t is templated]
            for start in range(0, len(positions), TOKENIZE_CHUNK):
                chunk = positions[start:start + TOKENIZE_CHUNK]
                encoded = self.tokenizer([texts[i][0] for i in chunk], add_special_tokens=not templated)["input_ids"]
                chunks.append(Ragged.of(encoded, np.int32))
                order += chunk
        return Ragged.concat(chunks).take(np.argsort(np.asarray(order, dtype=np.int64)))

    def _fingerprint(self) -> str:
        """A digest of what the items train on, in order: each prompt's ids, data source and ground truth
        (a checkpoint's data position fits only the same items: `PromptDataLoader.check_state_dict`)."""
        digest = hashlib.blake2b(digest_size=16)
        for item in self._items:
            digest.update(item["input_ids"].tobytes())
            digest.update(repr((item["data_source"], item["ground_truth"])).encode() + b"\0")
        return digest.hexdigest()

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self._items[i]
        # A copy, so that a caller editing a batch cannot corrupt later epochs.
        return {**item, "input_ids": list(item["input_ids"])}


# the shuffles a data loader state names: verl's with 1 or 2 draws an epoch, and the per-epoch seeds of
# runs saved before it
_ORDERS = ("draws per epoch: 1", "draws per epoch: 2", "seed + epoch")


class PromptDataLoader:
    """Batches of dataset items in a seeded order, resumable to the exact next batch.

    The items are shuffled in verl's order (in order when `shuffle=False`): verl's sampler
    (torchdata's `RandomSampler`) permutes the items with `torch.randperm(len(dataset))` from one
    generator seeded with `seed`, drawing at each epoch's start; its loader draws once an epoch
    without worker processes and twice with them (its multi-process iterator starts the sampler
    twice, and the second permutation is the epoch's). So with `draws_per_epoch` k, epoch `e` is the
    `(e + 1) * k`-th permutation. The order depends only on `(seed, epoch)` (a resume replays the
    draws), so a resumed run needs nothing but `{"epoch", "position"}` (and the dataset size it was
    saved over, `"size"`, to tell that the data is the same); it keeps the order it was saved with
    (`"order"`). A state saved without `"order"` is of a run whose epoch `e` was the permutation of a
    generator seeded with `seed + e`: it resumes in that order.

    `next_batch()` returns the next batch and rolls over to the next epoch as needed
    (the trainer's loop); iterating over the loader yields the rest of the current epoch.
    """

    def __init__(self, dataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True,
                 draws_per_epoch: int = 1) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if batch_size > len(dataset):
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts); "
                "lower data.train_batch_size or add prompts"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None
        self._order_epoch = -1
        if draws_per_epoch not in (1, 2):
            raise ValueError(f"draws_per_epoch must be 1 or 2, got {draws_per_epoch!r}")
        self.draws_per_epoch = draws_per_epoch
        self._per_epoch_seeds = False  # the order of runs saved before verl's (a state without "order")
        self._generator: torch.Generator | None = None
        self._draws = 0  # the permutations `_generator` drew
        self.batch_epoch = 0  # the epoch of the batch `next_batch` returned last (verl's training/epoch)

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from."""
        return self._epoch

    def __len__(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            n = len(self.dataset)
            if self.shuffle and self._per_epoch_seeds:
                generator = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(n, generator=generator).tolist()
            elif self.shuffle:
                draws = (self._epoch + 1) * self.draws_per_epoch
                if self._generator is None or self._draws > draws:
                    self._generator, self._draws = torch.Generator().manual_seed(self.seed), 0
                while self._draws < draws:  # a resume replays the earlier epochs' draws
                    self._order = torch.randperm(n, generator=self._generator).tolist()
                    self._draws += 1
            else:
                self._order = list(range(n))
            self._order_epoch = self._epoch
        return self._order

    def _has_batch(self) -> bool:
        remaining = len(self.dataset) - self._position
        return remaining >= self.batch_size or (remaining > 0 and not self.drop_last)

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch of items, starting a new epoch when the current one is done."""
        if not self._has_batch():
            self._epoch += 1
            self._position = 0
        order = self._epoch_order()
        self.batch_epoch = self._epoch
        end = min(self._position + self.batch_size, len(order))
        batch = [self.dataset[i] for i in order[self._position:end]]
        self._position = end
        # Advance eagerly so that a checkpoint taken after the last batch of an epoch
        # already points at the next epoch, and `__iter__` knows where the epoch ends.
        if not self._has_batch():
            self._epoch += 1
            self._position = 0
        return batch

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """Yields the remaining batches of the current epoch."""
        epoch = self._epoch
        while self._epoch == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int | str]:
        """`{"epoch", "position", "size", "order"}`: where the next batch starts, in a dataset of `size`
        items, shuffled as `order` says; and `"data"`, the dataset's `fingerprint` where it has one."""
        state = {"epoch": self._epoch, "position": self._position, "size": len(self.dataset),
                 "order": "seed + epoch" if self._per_epoch_seeds else f"draws per epoch: {self.draws_per_epoch}"}
        fingerprint = getattr(self.dataset, "fingerprint", None)
        return state if fingerprint is None else {**state, "data": fingerprint}

    def check_state_dict(self, state: dict[str, int | str]) -> None:
        """ValueError when `state` is not a position in this dataset: saved over a dataset of
        another size or other items (the files changed since; the batches would repeat or skip
        prompts, or the run would go on with other ones), or out of range."""
        n = len(self.dataset)
        size = state.get("size")  # absent from checkpoints written before it was saved
        changed = None
        if size is not None and int(size) != n:
            changed = f"its run trained on {size} prompts, and data.train_files (with the data options) now give {n}"
        elif state.get("data") not in (None, getattr(self.dataset, "fingerprint", None)):  # (absent: older)
            changed = (f"its run trained on other prompts or answers than data.train_files (with the data options) "
                       f"now give, as many ({n}) but not the same in the same order")
        if changed:
            raise ValueError(f"{changed}: the training data changed since it was written, so its place in the data "
                             "does not carry over; restore the files as they were, or start a fresh run "
                             "(trainer.resume_mode=disable or another trainer.default_local_dir) from its exported "
                             "model")
        if state.get("order") not in (None, *_ORDERS):
            raise ValueError(f"invalid data loader state {state}: order must be one of {', '.join(_ORDERS)}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= n:
            raise ValueError(f"invalid data loader state {state}: epoch must be >= 0 and position within [0, {n}] "
                             "(the dataset size)")

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume so that `next_batch()` returns the batch an uninterrupted run would."""
        self.check_state_dict(state)
        self._epoch, self._position = int(state["epoch"]), int(state["position"])
        order = state.get("order", "seed + epoch")
        self._per_epoch_seeds = order == "seed + epoch"
        if not self._per_epoch_seeds:
            self.draws_per_epoch = int(order.rsplit(" ", 1)[1])
        self._order_epoch, self._draws, self._generator = -1, 0, None
