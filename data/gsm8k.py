"""Convert GSM8K (`{"question", "answer"}` rows) to verl's prompt format.

    python -m data.gsm8k --input gsm8k_train.parquet --output data/gsm8k/train.parquet --split train

GSM8K answers end with `#### N`; `N` (commas removed) becomes the rule-based reward's
ground truth, and the prompt asks the model to end its answer the same way, which is
what the strict scorer in `rewards.gsm8k` checks. The prompt text and the
`extra_info` fields are verl's (`examples/data_preprocess/gsm8k.py`), so datasets
converted by either tool are interchangeable.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from data.dataset import DatasetError, read_records, write_records

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

_FINAL_ANSWER = re.compile(r"#### (-?[0-9.,]+)")


def extract_final_answer(answer: str) -> str | None:
    """The number after the last `#### ` in a GSM8K answer, commas removed; None if absent."""
    matches = _FINAL_ANSWER.findall(answer)
    return matches[-1].replace(",", "") if matches else None


def convert_row(row: dict[str, Any], index: int, split: str, where: str = "") -> dict[str, Any]:
    """One GSM8K row as a verl row; `where` prefixes error messages (e.g. `file:row`)."""
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
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


def convert_file(input_path: str, output_path: str, split: str = "train") -> int:
    """Convert a `.jsonl`/`.json`/`.parquet` GSM8K file; returns the number of rows written."""
    rows = [
        convert_row(row, index, split, where=f"{input_path}:{rownum}")
        for index, (rownum, row) in enumerate(read_records(input_path))
    ]
    if not rows:
        raise DatasetError(f"{input_path}: no rows")
    write_records(rows, output_path)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m data.gsm8k", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="GSM8K file (.jsonl, .json or .parquet)")
    parser.add_argument("--output", required=True, help="output file (.jsonl or .parquet)")
    parser.add_argument("--split", default="train", help="stored in extra_info.split (default: train)")
    args = parser.parse_args(argv)
    try:
        n = convert_file(args.input, args.output, args.split)
    except DatasetError as err:
        parser.exit(1, f"error: {err}\n")
    print(f"wrote {n} rows to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
