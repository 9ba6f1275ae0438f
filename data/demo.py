"""The built-in demo task: add two non-negative integers, verified by exact match.

Everything is generated locally (no downloads): a character-level tokenizer whose
vocabulary is the digits, `+ - * =`, space and a few special tokens, and prompt files
in verl's row format with prompts like `"37+58="` and ground truth `"95"`. The default
CPU config trains a tiny model on these files.

    python -m data.demo --out runs/demo_data
"""

from __future__ import annotations

import argparse
import os
import random
from dataclasses import dataclass
from typing import Any

from data.dataset import write_jsonl

__all__ = [
    "DATA_SOURCE",
    "DEMO_VOCAB_SIZE",
    "DemoPaths",
    "build_demo_tokenizer",
    "forgotten_carry",
    "make_demo_rows",
    "operands",
    "prepare_demo",
    "write_jsonl",
]

DATA_SOURCE = "meshppo/demo_add"

PAD, BOS, EOS, USER, ASSISTANT, UNK = (
    "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|unk|>",
)
# Special tokens come first so that pad is id 0, bos 1 and eos 2. `<|unk|>` exists so an
# unexpected character shows up as a token instead of silently vanishing from the input.
SPECIAL_TOKENS = (PAD, BOS, EOS, USER, ASSISTANT, UNK)
CHARACTERS = tuple("0123456789+-*= ")
DEMO_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

# Each message renders as `<|role|>content`; only the roles with a token are accepted,
# because `<|system|>` would otherwise be spelled out as unknown characters.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['user', 'assistant'] %}"
    "{{ raise_exception('the demo tokenizer only supports the user and assistant roles, got ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_demo_tokenizer(out_dir: str | os.PathLike | None = None):
    """Build the demo's character-level tokenizer, saving it to `out_dir` if given.

    Returns a `transformers` fast tokenizer with `pad_token`, `bos_token`, `eos_token`
    and a `chat_template`; encoding adds no special tokens, so `tokenizer("12+3=")`
    gives exactly one id per character. `AutoTokenizer.from_pretrained(out_dir)` loads
    the saved copy.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    # Fuse joins the characters back without the spaces a word-level decoder would insert.
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        # Spaces are real characters here; the default clean-up would delete some of them.
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        tokenizer.save_pretrained(os.fspath(out_dir))
    return tokenizer


def _sample_pairs(
    rng: random.Random, n: int, min_value: int, max_value: int, exclude: set[tuple[int, int]]
) -> list[tuple[int, int]]:
    if not 0 <= min_value <= max_value:
        raise ValueError(f"need 0 <= min_value <= max_value, got min_value={min_value}, max_value={max_value}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    width = max_value - min_value + 1
    excluded = {(a, b) for a, b in exclude if min_value <= a <= max_value and min_value <= b <= max_value}
    available = width * width - len(excluded)
    if n > available:
        raise ValueError(
            f"asked for {n} distinct pairs but only {available} exist in "
            f"[{min_value}, {max_value}]^2 after excluding {len(excluded)}; raise max_value"
        )
    if width * width <= 1_000_000:
        candidates = [(min_value + c // width, min_value + c % width) for c in range(width * width)]
        return rng.sample([p for p in candidates if p not in excluded], n)
    # The space is too large to list; rejection sampling is cheap because n << space.
    drawn: set[tuple[int, int]] = set()
    pairs = []
    while len(pairs) < n:
        pair = (rng.randint(min_value, max_value), rng.randint(min_value, max_value))
        if pair not in drawn and pair not in excluded:
            drawn.add(pair)
            pairs.append(pair)
    return pairs


def operands(row: dict[str, Any]) -> tuple[int, int]:
    """`(a, b)` of a demo row (its prompt is `"a+b="`)."""
    a, b = row["prompt"][0]["content"].removesuffix("=").split("+")
    return int(a), int(b)


def forgotten_carry(a: int, b: int) -> int:
    """`a + b` written by someone who forgets the carry out of the units column
    (`37+58` -> 85, `95+7` -> 92); `a + b` when there is no such carry. The systematic slip
    of the demonstrations that the demo's supervised warm-up imitates (`tools.prepare_demo`)."""
    return a + b - 10 if a % 10 + b % 10 >= 10 else a + b


def _rows(pairs: list[tuple[int, int]], split: str) -> list[dict[str, Any]]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"split": split, "index": i},
        }
        for i, (a, b) in enumerate(pairs)
    ]


def make_demo_rows(
    n: int,
    seed: int,
    min_value: int = 0,
    max_value: int = 99,
    split: str = "train",
    exclude: set[tuple[int, int]] | None = None,
) -> list[dict[str, Any]]:
    """`n` addition problems with distinct `(a, b)` pairs, in verl's row format.

    Deterministic in `seed`. Pairs in `exclude` are never drawn (used to keep the
    validation split disjoint from the training split).
    """
    return _rows(_sample_pairs(random.Random(seed), n, min_value, max_value, set(exclude or ())), split)


@dataclass(frozen=True)
class DemoPaths:
    """Where `prepare_demo` wrote the demo's files."""

    tokenizer_dir: str
    """Directory loadable with `AutoTokenizer.from_pretrained`."""
    train_file: str
    """Training prompts (`train.jsonl`)."""
    val_file: str
    """Validation prompts (`val.jsonl`), disjoint from training on the `(a, b)` pair."""


def prepare_demo(
    out_dir: str | os.PathLike,
    n_train: int = 4096,
    n_val: int = 256,
    seed: int = 0,
    min_value: int = 0,
    max_value: int = 99,
) -> DemoPaths:
    """Write `tokenizer/`, `train.jsonl` and `val.jsonl` under `out_dir`; returns their paths."""
    if not 0 <= min_value <= max_value:
        raise ValueError(f"need 0 <= min_value <= max_value, got min_value={min_value}, max_value={max_value}")
    width = max_value - min_value + 1
    if n_train + n_val > width * width:
        # Checked before writing anything, so a bad request leaves no half-written directory.
        raise ValueError(
            f"n_train + n_val = {n_train + n_val} exceeds the {width * width} distinct pairs in "
            f"[{min_value}, {max_value}]^2; raise max_value"
        )
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer_dir = os.path.join(out_dir, "tokenizer")
    build_demo_tokenizer(tokenizer_dir)
    rng = random.Random(seed)
    train_pairs = _sample_pairs(rng, n_train, min_value, max_value, set())
    # Excluding the training pairs makes the validation score measure generalisation
    # rather than memorisation.
    val_pairs = _sample_pairs(rng, n_val, min_value, max_value, set(train_pairs))
    return DemoPaths(
        tokenizer_dir=tokenizer_dir,
        train_file=write_jsonl(_rows(train_pairs, "train"), os.path.join(out_dir, "train.jsonl")),
        val_file=write_jsonl(_rows(val_pairs, "val"), os.path.join(out_dir, "val.jsonl")),
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: write the demo tokenizer and prompt files."""
    parser = argparse.ArgumentParser(prog="python -m data.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n-train", type=int, default=4096)
    parser.add_argument("--n-val", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-value", type=int, default=0)
    parser.add_argument("--max-value", type=int, default=99)
    args = parser.parse_args(argv)
    for flag, value in (("--n-train", args.n_train), ("--n-val", args.n_val)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    from trainer.configlib import ConfigError
    from trainer.setup import check_output_dir

    try:
        check_output_dir("--out", args.out)
    except ConfigError as e:
        parser.error(str(e))
    try:
        paths = prepare_demo(args.out, args.n_train, args.n_val, args.seed, args.min_value, args.max_value)
    except ValueError as err:
        parser.exit(1, f"error: {err}\n")
    print(f"tokenizer: {paths.tokenizer_dir}\ntrain: {paths.train_file}\nval: {paths.val_file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
