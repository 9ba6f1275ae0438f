"""The trainer's ranks share a dataset's tokenizing (`RLHFDataset(across_ranks=True)`): rank r renders and
tokenizes rows r::world_size alone and the ranks all-gather the ids. Every rank tokenized every prompt
before (37-50 s per 100k rows on each rank). On 2 and 3 gloo ranks, over 301 rows in two files (a count
neither divides), chat and plain prompts mixed and some filtered as overlong, every rank's dataset is the
single process's: the same items, ids, filtered count and fingerprint; and each rank tokenized its share
of the prompts only. A bad row stops every rank with the error one process raises, naming the file and
row, where only the row's own rank can see what is wrong with it (its chat template fails), also when
other ranks find another error in a later row or in the same row; a rank whose tokenizer fails stops the
others too. Every rank then meets the others in a collective: none is left waiting."""

from __future__ import annotations

import json

import pytest

from tests.dist_utils import run_distributed

ROWS = 301
LIMIT = 36  # max_prompt_length: about a quarter of the prompts are longer (79 of 301)


def _row(i: int) -> dict:
    """Row i: a chat prompt (two rows in three) or a plain one, of a length that varies with i."""
    from data.demo import DATA_SOURCE

    text = " ".join(f"{i}+{j}=" for j in range(1 + i % 7))
    prompt = text if i % 3 == 0 else [{"role": "user", "content": text}]
    return {"data_source": DATA_SOURCE, "prompt": prompt, "reward_model": {"ground_truth": str(i)},
            "extra_info": {"index": i}}


def _write(tmp: str, rows: list[dict]) -> list[str]:
    """The rows in two JSON-lines files (the first 100, the rest)."""
    paths = [f"{tmp}/a.jsonl", f"{tmp}/b.jsonl"]
    for path, part in zip(paths, (rows[:100], rows[100:])):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in part)
    return paths


def _counting(tokenizer, counts: list[int]):
    """`tokenizer`, whose calls add the number of texts they tokenize to `counts`."""
    call = type(tokenizer).__call__

    def counted(self, texts, *args, **kwargs):
        counts.append(len(texts))
        return call(self, texts, *args, **kwargs)

    type(tokenizer).__call__ = counted
    return tokenizer


def _build(files, tokenizer, across_ranks):
    from data import RLHFDataset

    return RLHFDataset(files, tokenizer, max_prompt_length=LIMIT, filter_overlong_prompts=True,
                       across_ranks=across_ranks)


def _items(dataset) -> list[dict]:
    return [dataset[i] for i in range(len(dataset))]


def _everyone_comes_out(world):
    """Every rank left the dataset's build: they meet in this collective."""
    from sharding import comm

    assert comm.all_reduce_values([1.0], "sum")[0] == world


def _same_as_one_process(rank, world, tmp, tokenizer_dir):
    import transformers

    files = _write(tmp, [_row(i) for i in range(ROWS)]) if rank == 0 else [f"{tmp}/a.jsonl", f"{tmp}/b.jsonl"]
    _everyone_comes_out(world)  # (the files are written)
    counts: list[int] = []
    tokenizer = _counting(transformers.AutoTokenizer.from_pretrained(tokenizer_dir), counts)
    one = _build(files, tokenizer, across_ranks=False)
    assert sum(counts) == ROWS and 0 < one.num_filtered < ROWS // 2
    counts.clear()
    shared = _build(files, tokenizer, across_ranks=True)
    assert sum(counts) == len(range(rank, ROWS, world))  # this rank's rows, and no other
    assert _items(shared) == _items(one)
    assert (shared.num_filtered, shared.fingerprint, len(shared)) == (one.num_filtered, one.fingerprint, len(one))
    _everyone_comes_out(world)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_sharing_the_tokenizing_build_one_process_s_dataset(tmp_path, world):
    from data.demo import build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    run_distributed(_same_as_one_process, world, str(tmp_path), str(tmp_path / "tok"), timeout=120)


# Row 8 (position 7: rank 1's of 2 and of 3) has a system message, on which the demo's chat template fails:
# only rank 1 renders it. The others find a later row's error, or the same row's data_source.
BAD_ROWS = {
    "a later row's error elsewhere": {7: {"prompt": [{"role": "system", "content": "1+1="}]}, 20: {"prompt": None}},
    "another error in the same row": {7: {"prompt": [{"role": "system", "content": "1+1="}], "data_source": 5}},
}


def _bad_row_stops_every_rank(rank, world, tmp, tokenizer_dir, changes):
    import transformers

    from data import DatasetError

    rows = [_row(i) for i in range(ROWS)]
    for position, change in changes.items():
        rows[position].update(change)
    files = _write(tmp, rows) if rank == 0 else [f"{tmp}/a.jsonl", f"{tmp}/b.jsonl"]
    _everyone_comes_out(world)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(DatasetError) as one:
        _build(files, tokenizer, across_ranks=False)
    assert str(one.value).startswith(f"{tmp}/a.jsonl:8: the chat template failed on field 'prompt'")
    with pytest.raises(DatasetError) as shared:
        _build(files, tokenizer, across_ranks=True)
    assert str(shared.value) == str(one.value)
    _everyone_comes_out(world)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_only_its_rank_renders_stops_every_rank_naming_it(tmp_path, world, case):
    from data.demo import build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    run_distributed(_bad_row_stops_every_rank, world, str(tmp_path), str(tmp_path / "tok"), BAD_ROWS[case],
                    timeout=120)


def _failing_tokenizer_stops_every_rank(rank, world, tmp, tokenizer_dir):
    import transformers

    files = _write(tmp, [_row(i) for i in range(ROWS)]) if rank == 0 else [f"{tmp}/a.jsonl", f"{tmp}/b.jsonl"]
    _everyone_comes_out(world)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    if rank == 1:
        def broken(self, texts, *args, **kwargs):
            raise MemoryError("the tokenizer ran out of memory")

        type(tokenizer).__call__ = broken
    own = "the tokenizer ran out of memory" if rank == 1 else (
        r"\(on rank 1, building the dataset\) MemoryError: the tokenizer ran out of memory")
    with pytest.raises(MemoryError if rank == 1 else RuntimeError, match=own):
        _build(files, tokenizer, across_ranks=True)
    _everyone_comes_out(world)


def test_a_rank_whose_tokenizer_fails_stops_every_rank(tmp_path):
    from data.demo import build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    run_distributed(_failing_tokenizer_stops_every_rank, 3, str(tmp_path), str(tmp_path / "tok"), timeout=120)


def _other_rows_stop_every_rank(rank, world, tmp, tokenizer_dir, change):
    """Each rank reads its own copy of the files; rank 2's differs (`change`: a row's content, or one row
    fewer): every rank refuses, naming the files and rank 2, instead of taking ids of rows it lacks."""
    import os

    import transformers

    from data import DatasetError

    rows = [_row(i) for i in range(ROWS)]
    theirs = ROWS - 1 if change == "a row fewer" else ROWS
    if rank == 2:
        rows = rows[:-1] if change == "a row fewer" else [*rows[:50], {**rows[50], "prompt": "9+9="}, *rows[51:]]
    own = f"{tmp}/rank{rank}"
    os.makedirs(own)
    files = _write(own, rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(DatasetError, match=r"rank\d/a.jsonl, .*b.jsonl: ranks \[2\] read other rows than rank 0 "
                                           rf"\(rank 0: {ROWS} rows; rank 2: {theirs} rows\)"):
        _build(files, tokenizer, across_ranks=True)
    _everyone_comes_out(world)


@pytest.mark.parametrize("change", ["a row fewer", "a row's prompt"])
def test_ranks_that_read_other_rows_stop_naming_the_files(tmp_path, change):
    from data.demo import build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    run_distributed(_other_rows_stop_every_rank, 3, str(tmp_path), str(tmp_path / "tok"), change, timeout=120)


# (rows, build options): fewer rows than ranks (ranks with no prompt to tokenize), one row, a parquet part with
# a drawn subset, and a build whose every row is filtered (every rank raises the one process's error)
SMALL_CASES = [(1, {}), (2, {}), (4, {}), (11, {"max_samples": 5, "shuffle": True, "seed": 3}),
               (7, {"max_prompt_length": 1}), (5, {"max_prompt_length": 9, "filter_overlong_prompts": False,
                                                   "truncation": "middle"})]


def _small_builds_same_as_one_process(rank, world, tmp, tokenizer_dir):
    import transformers

    from data import RLHFDataset, write_records

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    for case, (rows, options) in enumerate(SMALL_CASES):
        files = [f"{tmp}/{case}a.jsonl", f"{tmp}/{case}b.parquet"]
        if rank == 0:  # text and chat prompts in the JSON lines, chat prompts alone in the parquet part
            write_records([_row(i) for i in range(rows // 2)], files[0])
            write_records([{**_row(i), "prompt": [{"role": "user", "content": f"{i}+{i}="}]}
                           for i in range(rows // 2, rows)], files[1])
        _everyone_comes_out(world)
        built = []
        for across_ranks in (False, True):
            try:
                ds = RLHFDataset(files, tokenizer, **{"max_prompt_length": LIMIT, "filter_overlong_prompts": True,
                                                      **options, "across_ranks": across_ranks})
                built.append((_items(ds), ds.num_filtered, ds.fingerprint))
            except Exception as err:  # (the all-filtered case)
                built.append((type(err).__name__, str(err)))
        assert built[1] == built[0], (case, rows, options)
        _everyone_comes_out(world)


def test_small_datasets_build_the_same_across_ranks(tmp_path):
    """Fewer rows than the 3 ranks, one row, a parquet part and a drawn subset, truncated prompts and a build
    that filters every row: each rank's items (or error) are the single process's."""
    from data.demo import build_demo_tokenizer

    build_demo_tokenizer(tmp_path / "tok")
    run_distributed(_small_builds_same_as_one_process, 3, str(tmp_path), str(tmp_path / "tok"), timeout=120)
