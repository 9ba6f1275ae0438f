"""Convert GSM8K (`{"question", "answer"}` rows) to verl's prompt format.

    python -m data.gsm8k --input gsm8k_train.parquet --output data/gsm8k/train.parquet --split train

GSM8K answers end with `#### N`; `N` (commas removed, as the scorer removes them from
responses; a `$` and a sentence's full stop dropped) becomes the rule-based reward's
ground truth, and the prompt asks the model to end its answer the same way, which is
what the strict scorer in `rewards.gsm8k` checks. The prompt text and the
`extra_info` fields are verl's (`examples/data_preprocess/gsm8k.py`), so GSM8K converted
by either tool gives the same rows (an answer ending `5.` or `$5`, which GSM8K has none of,
would not: verl's regex keeps the full stop and cannot read the `$`).

With `--multiturn` (or `--multiturn tool`) the rows are verl's tool-calling ones (`examples/data_preprocess/
gsm8k_multiturn_w_tool.py`), for multi-turn rollouts with `configs/tools/gsm8k_tool.yaml`: a system
message tells the model to solve step by step and submit its answer to the `calc_gsm8k_reward`
tool before answering, the user message is the question with verl's instruction for this format
(`####` in backticks), and `extra_info` adds `need_tools_kwargs`, `tools_kwargs` (the tool is
created with the row's ground truth: `{calc_gsm8k_reward: {create_kwargs: {ground_truth}}}`) and
`interaction_kwargs` (`query`, the user message, and `ground_truth`), as verl writes them.

With `--multiturn interaction` the rows are verl's interaction ones (`examples/data_preprocess/
gsm8k_multiturn_w_interaction.py`), for multi-turn rollouts with
`configs/interactions/gsm8k_interaction.yaml`: the system message tells the model to solve step by
step, to rethink when the user says it is wrong, and to answer as `#### <answer>`; the user message
is the same as the tool rows'; `extra_info` adds only `interaction_kwargs` (`name: gsm8k`, which
picks the interaction, `query` and `ground_truth`).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from data.dataset import DatasetError, _file_kind, read_records, write_records

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The tool-calling rows' texts and tool name, verl's (examples/data_preprocess/gsm8k_multiturn_w_tool.py).
MULTITURN_INSTRUCTION = "Let's think step by step and output the final answer after `####`."
MULTITURN_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "Reasoning step by step before any tool call. "
    "You should use the `calc_gsm8k_reward` tool after step by step solving the question, "
    "before generate final answer at least once and refine your answer if necessary. "
    "Put your final answer in the format of `#### <answer>`."
)
TOOL_NAME = "calc_gsm8k_reward"
# The interaction rows' system prompt and interaction name, verl's
# (examples/data_preprocess/gsm8k_multiturn_w_interaction.py).
INTERACTION_SYSTEM_PROMPT = (
    "You are a math expert. You are given a question and you need to solve it step by step. "
    "You should rethinking carefully if user point out your answer is wrong. "
    "Put your final answer in the format of `#### <answer>`."
)
INTERACTION_NAME = "gsm8k"
# The multi-turn variants of the rows: verl's tool-calling rows and its interaction rows.
MULTITURN_KINDS = ("tool", "interaction")

# The whole tail after the last `#### `: an optional `$` (dropped: verl's regex cannot read it, and
# `rewards.gsm8k` does not accept it in a response either), an integer with optional thousands commas
# and decimal part, and an optional full stop that ends the sentence (dropped; verl's regex keeps it in
# the ground truth). Anchored at the end so that `#### 3/4` is refused rather than read as 3; no GSM8K
# answer has any of these forms.
_FINAL_ANSWER = re.compile(r"#### \$?(-?[0-9][0-9,]*(?:\.[0-9]+)?)\.?\s*\Z")


def extract_final_answer(answer: str) -> str | None:
    """The number that ends a GSM8K answer after `#### `, without `$`, commas or a final
    full stop (the form `rewards.gsm8k` compares); None if the answer ends otherwise."""
    match = _FINAL_ANSWER.search(answer)
    return match.group(1).replace(",", "") if match else None


def _check_multiturn(multiturn: str | None) -> None:
    if multiturn is not None and multiturn not in MULTITURN_KINDS:
        raise ValueError(f"multiturn must be None or one of {list(MULTITURN_KINDS)}, got {multiturn!r}")


def convert_row(row: dict[str, Any], index: int, split: str, where: str = "",
                multiturn: str | None = None) -> dict[str, Any]:
    """One GSM8K row as a verl row (`multiturn`: `tool` for verl's tool-calling row, `interaction`
    for its interaction row, None for the single-turn row); `where` prefixes error messages (e.g.
    `file:row`)."""
    _check_multiturn(multiturn)
    prefix = f"{where}: " if where else ""
    for key in ("question", "answer"):
        if key not in row or row[key] is None:
            raise DatasetError(f"{prefix}missing field '{key}'")
        if not isinstance(row[key], str):
            raise DatasetError(f"{prefix}field '{key}' must be a string, got {type(row[key]).__name__}")
    question, answer = row["question"], row["answer"]
    ground_truth = extract_final_answer(answer)
    if ground_truth is None:
        raise DatasetError(f"{prefix}field 'answer' does not end with '#### <number>': {answer[-80:]!r}")
    query = f"{question} {MULTITURN_INSTRUCTION}"
    if multiturn == "interaction":
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": INTERACTION_SYSTEM_PROMPT}, {"role": "user", "content": query}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {
                "split": split, "index": index, "answer": answer, "question": question,
                "interaction_kwargs": {"name": INTERACTION_NAME, "query": query, "ground_truth": ground_truth},
            },
        }
    if multiturn == "tool":
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": MULTITURN_SYSTEM_PROMPT}, {"role": "user", "content": query}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth},
            "extra_info": {
                "split": split, "index": index, "answer": answer, "question": question,
                "need_tools_kwargs": True,
                "tools_kwargs": {TOOL_NAME: {"create_kwargs": {"ground_truth": ground_truth}}},
                "interaction_kwargs": {"query": query, "ground_truth": ground_truth},
            },
        }
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def _write_atomically(rows: list[dict[str, Any]], output_path: str) -> None:
    """Write `rows` to a temporary file beside `output_path`, then rename it into place, so an
    interrupted or failed write never leaves a truncated output; OS errors become `DatasetError`."""
    parent = os.path.dirname(output_path) or "."
    existing = parent
    while not os.path.exists(existing) and os.path.dirname(existing) not in ("", existing):
        existing = os.path.dirname(existing)
    if os.path.exists(existing) and not os.path.isdir(existing):
        raise DatasetError(f"{output_path}: cannot write the output: {existing} is not a directory")
    stem, ext = os.path.splitext(os.path.basename(output_path))
    tmp = os.path.join(parent, f".{stem}.tmp-{os.getpid()}{ext}")  # same extension: same format
    try:
        write_records(rows, tmp)
        os.replace(tmp, output_path)
    except OSError as err:
        raise DatasetError(f"{output_path}: cannot write the output: {err.strerror or err}") from err
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def convert_file(input_path: str, output_path: str, split: str = "train", multiturn: str | None = None) -> int:
    """Convert a `.jsonl`/`.json`/`.parquet` GSM8K file (`multiturn`: `tool` or `interaction`, to
    verl's multi-turn rows of that kind); returns the number of rows written.

    The output replaces `output_path` only once every row has converted; writing over the
    input itself is refused before anything is read.
    """
    _check_multiturn(multiturn)
    input_path, output_path = os.fspath(input_path), os.fspath(output_path)
    _file_kind(output_path)  # an unsupported output type fails before the work, not after
    if os.path.realpath(input_path) == os.path.realpath(output_path) or (
            os.path.exists(output_path) and os.path.exists(input_path) and os.path.samefile(input_path, output_path)):
        raise DatasetError(f"{output_path}: the output is the input file; write the converted rows elsewhere")
    try:
        records = read_records(input_path)
    except OSError as err:  # e.g. permission denied
        raise DatasetError(f"{input_path}: cannot read: {err.strerror or err}") from err
    rows = [
        convert_row(row, index, split, where=f"{input_path}:{rownum}", multiturn=multiturn)
        for index, (rownum, row) in enumerate(records)
    ]
    if not rows:
        raise DatasetError(f"{input_path}: no rows")
    _write_atomically(rows, output_path)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m data.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="GSM8K file (.jsonl, .json or .parquet)")
    parser.add_argument("--output", required=True, help="output file: .parquet, or .jsonl / .json for JSON lines")
    parser.add_argument("--split", default="train", help="stored in extra_info.split (default: train)")
    parser.add_argument("--multiturn", nargs="?", const="tool", choices=MULTITURN_KINDS, default=None,
                        help="verl's multi-turn rows: 'tool' (the default when no value is given) for the "
                             "calc_gsm8k_reward tool, 'interaction' for the gsm8k interaction")
    args = parser.parse_args(argv)
    try:
        n = convert_file(args.input, args.output, args.split, multiturn=args.multiturn)
    except DatasetError as err:
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {n} rows to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
