"""Datasets, the prompt loader, the demo task and tokenizer, and the GSM8K converter."""

import json
import logging
import re

import pytest

from data import DatasetError, PromptDataLoader, RLHFDataset, read_records, write_jsonl, write_records
from data.demo import (
    CHAT_TEMPLATE,
    DATA_SOURCE,
    DEMO_VOCAB_SIZE,
    build_demo_tokenizer,
    forgotten_carry,
    make_demo_rows,
    operands,
    prepare_demo,
)
from data.gsm8k import INSTRUCTION, convert_file, main as gsm8k_main

transformers = pytest.importorskip("transformers")

# Ids as laid out by build_demo_tokenizer: 6 special tokens, then "0".."9", "+", "-", "*", "=", " ".
PAD, BOS, EOS, USER, ASSISTANT, UNK = range(6)
DIGIT = {str(d): 6 + d for d in range(10)}
PLUS, MINUS, TIMES, EQ, SPACE = 16, 17, 18, 19, 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(out)
    return str(out)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def text_of(dataset, i):
    """The text item `i`'s prompt ids were tokenized from (its chat rendered; the dataset keeps the ids alone)."""
    item = dataset[i]
    return dataset._prompt_text(item["raw_prompt"], item["where"], item["agent_name"], item["tool_selection"])[0]


def texts_of(dataset):
    return [text_of(dataset, i) for i in range(len(dataset))]


def _chat_row(content, answer="1", **extra):
    row = {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": content}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer}}
    row.update(extra)
    return row


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# ---- demo tokenizer


def test_tokenizer_is_character_level_without_added_specials(tokenizer):
    assert len(tokenizer) == DEMO_VOCAB_SIZE == 21
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (PAD, BOS, EOS)
    assert tokenizer("12+3=")["input_ids"] == [DIGIT["1"], DIGIT["2"], PLUS, DIGIT["3"], EQ]
    assert tokenizer("9 - 4*0")["input_ids"] == [DIGIT["9"], SPACE, MINUS, SPACE, DIGIT["4"], TIMES, DIGIT["0"]]
    assert tokenizer("1a")["input_ids"] == [DIGIT["1"], UNK]
    assert tokenizer.convert_ids_to_tokens([USER, ASSISTANT]) == ["<|user|>", "<|assistant|>"]


@pytest.mark.parametrize("text", ["37+58=95", " 1 + 2 = 3 ", "<|user|>5*5=<|assistant|>25<|eos|>", ""])
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_decode_skips_special_tokens(tokenizer):
    ids = tokenizer("<|assistant|>95<|eos|><|pad|>")["input_ids"]
    assert ids == [ASSISTANT, DIGIT["9"], DIGIT["5"], EOS, PAD]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "95"


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "1+2="}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>1+2=<|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == [USER, DIGIT["1"], PLUS, DIGIT["2"], EQ, ASSISTANT]
    convo = messages + [{"role": "assistant", "content": "3"}]
    assert tokenizer.apply_chat_template(convo, tokenize=False) == "<|user|>1+2=<|assistant|>3"
    assert tokenizer.chat_template == CHAT_TEMPLATE
    with pytest.raises(Exception, match="only supports the user and assistant roles, got system"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)


# ---- demo rows and files


def test_make_demo_rows_format_and_determinism():
    rows = make_demo_rows(50, seed=3, max_value=20, split="val")
    assert rows == make_demo_rows(50, seed=3, max_value=20, split="val")
    assert rows != make_demo_rows(50, seed=4, max_value=20, split="val")
    pairs = set()
    for i, row in enumerate(rows):
        assert set(row) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
        assert row["data_source"] == "meshppo/demo_add" and row["ability"] == "math"
        assert row["extra_info"] == {"split": "val", "index": i}
        [message] = row["prompt"]
        assert message["role"] == "user" and message["content"] == "{}+{}=".format(*operands(row))
        a, b = operands(row)
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(a + b)}
        pairs.add((a, b))
    assert len(pairs) == 50


@pytest.mark.parametrize("a,b,written", [
    (37, 58, 85), (95, 7, 92), (5, 5, 0), (99, 99, 188), (9, 91, 90),  # the units carry is dropped
    (37, 52, 89), (90, 10, 100), (0, 0, 0), (64, 35, 99),  # no units carry: the true sum
])
def test_forgotten_carry(a, b, written):
    assert forgotten_carry(a, b) == forgotten_carry(b, a) == written


def test_make_demo_rows_exclude_and_exhaustion():
    every_pair_but_one = {(a, b) for a in range(3) for b in range(3)} - {(2, 1)}
    [row] = make_demo_rows(1, seed=0, max_value=2, exclude=every_pair_but_one)
    assert row["prompt"][0]["content"] == "2+1=" and row["reward_model"]["ground_truth"] == "3"
    with pytest.raises(ValueError, match="asked for 2 distinct pairs but only 1 exist"):
        make_demo_rows(2, seed=0, max_value=2, exclude=every_pair_but_one)


def test_prepare_demo_writes_disjoint_splits_loadable_by_the_dataset(tmp_path):
    paths = prepare_demo(tmp_path / "demo", n_train=300, n_val=40, seed=7, max_value=30)
    train = [row for _, row in read_records(paths.train_file)]
    val = [row for _, row in read_records(paths.val_file)]
    assert (len(train), len(val)) == (300, 40)
    # The training file is exactly make_demo_rows with the same seed and range.
    assert train == make_demo_rows(300, seed=7, max_value=30)
    prompts = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(prompts(val)) == 40 and not prompts(train) & prompts(val)
    assert {r["extra_info"]["split"] for r in val} == {"val"}

    tok = transformers.AutoTokenizer.from_pretrained(paths.tokenizer_dir)
    dataset = RLHFDataset(paths.val_file, tok, max_prompt_length=16)
    item = dataset[0]
    a, b = map(int, item["raw_prompt"][0]["content"][:-1].split("+"))
    assert text_of(dataset, 0) == f"<|user|>{a}+{b}=<|assistant|>"
    assert item["input_ids"][0] == USER and item["input_ids"][-2:] == [EQ, ASSISTANT]
    assert item["ground_truth"] == str(a + b) and item["data_source"] == DATA_SOURCE

    with pytest.raises(ValueError, match="exceeds the 16 distinct pairs"):
        prepare_demo(tmp_path / "too_many", n_train=10, n_val=7, max_value=3)
    assert not (tmp_path / "too_many").exists()


def test_demo_cli(tmp_path, capsys):
    from data.demo import main

    assert main(["--out", str(tmp_path), "--n-train", "5", "--n-val", "2", "--max-value", "9"]) == 0
    assert len(read_records(tmp_path / "train.jsonl")) == 5 and len(read_records(tmp_path / "val.jsonl")) == 2
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    assert "train: " in capsys.readouterr().out


def test_prepare_demo_rejects_a_slip_outside_0_1(tmp_path, capsys):
    from tools.prepare_demo import main

    with pytest.raises(SystemExit) as err:
        main(["--out", str(tmp_path / "assets"), "--slip", "1.5"])
    assert err.value.code == 2 and "--slip must be in [0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "assets").exists()


def test_demo_tools_refuse_bad_output_and_ranges_before_writing(tmp_path, capsys):
    from data.demo import main as demo_main
    from tools.prepare_demo import main as prepare_main

    afile = tmp_path / "afile"
    afile.write_text("")
    cases = [(demo_main, ["--out", str(tmp_path / "d"), "--n-train", "-5"], "--n-train must be at least 1, got -5"),
             (demo_main, ["--out", str(tmp_path / "d"), "--n-val", "0"], "--n-val must be at least 1, got 0"),
             (demo_main, ["--out", str(afile / "d")], f"is under {afile}, a file"),
             (prepare_main, ["--out", str(afile / "d")], f"is under {afile}, a file"),
             # operands of 16 digits: 36-token prompts, past what the demonstrator's training reads
             (prepare_main, ["--out", str(tmp_path / "d"), "--max-value", str(10 ** 15), "--n-train", "10",
                             "--n-val", "2"], "its prompts are up to 36 tokens, more than the 32")]
    for main, argv, message in cases:
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2 and message in capsys.readouterr().err, argv
    assert not (tmp_path / "d").exists() and afile.read_text() == ""


# ---- RLHFDataset


def test_dataset_items_text_and_chat_prompts(tmp_path, tokenizer):
    path = write_jsonl([
        _chat_row("12+3=", "15", extra_info={"index": 7}),
        {"prompt": "4+4=", "data_source": "mine", "reward_model": {"ground_truth": 8}},
        {"prompt": "1+1="},
        {"prompt": "2+2=", "reward_model": {"ground_truth": 4.0}},
        {"prompt": "2+2=", "reward_model": {"ground_truth": 0.5}},
    ], tmp_path / "d.jsonl")
    ds = RLHFDataset([path], tokenizer, require_ground_truth=False)
    assert len(ds) == 5 and ds.num_filtered == 0
    # ground truths as stored, unconverted (verl hands them to the reward function as they are)
    assert [ds[i]["ground_truth"] for i in range(1, 5)] == [8, None, 4.0, 0.5]
    assert type(ds[1]["ground_truth"]) is int and type(ds[3]["ground_truth"]) is float
    assert ds[0] == {
        "input_ids": [USER, DIGIT["1"], DIGIT["2"], PLUS, DIGIT["3"], EQ, ASSISTANT],
        "raw_prompt": [{"role": "user", "content": "12+3="}],
        "data_source": DATA_SOURCE,
        "ground_truth": "15",
        "extra_info": {"index": 7},
        "agent_name": "single_turn_agent",
        "tools_kwargs": {},
        "tool_selection": None,
        "index": 0,
        "where": f"{path}:1",
    }
    assert ds[4]["where"] == f"{path}:5" and text_of(ds, 0) == "<|user|>12+3=<|assistant|>"
    # Text prompts are not templated.
    assert ds[1]["input_ids"] == [DIGIT["4"], PLUS, DIGIT["4"], EQ] and text_of(ds, 1) == "4+4="
    assert ds[1]["extra_info"] == {}
    assert ds[2]["ground_truth"] is None and ds[2]["data_source"] is None and ds[2]["index"] == 2
    # Items are copies: editing one does not change the dataset.
    ds[0]["input_ids"].append(PAD)
    assert len(ds[0]["input_ids"]) == 7



def test_dataset_that_must_hold_chat_messages_names_a_text_row(tmp_path, tokenizer):
    """`chat_prompts_for` (a reward model rendering the chats with its own template): chat rows
    load as usual, a text row fails at load naming its file and row and the reason given."""
    path = write_jsonl([_chat_row("12+3=", "15"), {"prompt": "4+4=", "reward_model": {"ground_truth": 8}}],
                       tmp_path / "d.jsonl")
    assert len(RLHFDataset([path], tokenizer, max_samples=1, chat_prompts_for="why")) == 1
    with pytest.raises(DatasetError, match=r"d.jsonl:2: field 'prompt' is text, not a list of chat messages: why$"):
        RLHFDataset([path], tokenizer, chat_prompts_for="why")


def test_a_row_with_images_or_videos_is_refused_naming_it(tmp_path, tokenizer):
    """meshppo's models are text-only: a vision-language row (verl's images / videos fields, named by
    data.image_key / video_key, or an image part in a message) fails at load naming the file, row and
    field, rather than being trained on without its images. An empty field is no media."""
    ok = _chat_row("1+1=", "2", images=[])
    rows = {"images": _chat_row("1+1=", "2", images=[{"image": "a.png"}]),
            "frames": _chat_row("1+1=", "2", frames=["v.mp4"]),
            "part": {"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "1+1="}]}],
                     "reward_model": {"ground_truth": "2"}}}
    expected = {"images": r"d.jsonl:2: field 'images' holds media: meshppo's models are text-only",
                "frames": r"d.jsonl:2: field 'frames' holds media",
                "part": r"d.jsonl:2: field 'prompt' message 0 has a part of type 'image': meshppo's models are text-only"}
    for name, row in rows.items():
        path = write_jsonl([ok, row], tmp_path / "d.jsonl")
        with pytest.raises(DatasetError, match=expected[name]):
            RLHFDataset([path], tokenizer, media_keys=("images", "frames"))
    assert len(RLHFDataset([write_jsonl([ok], tmp_path / "d.jsonl")], tokenizer)) == 1

def test_dataset_multiple_files_parquet_and_custom_prompt_key(tmp_path, tokenizer):
    a = write_jsonl([{"question": "1+2=", "reward_model": {"ground_truth": "3"}}], tmp_path / "a.jsonl")
    b = write_records([_chat_row("3+4=", question="5+6=")], tmp_path / "b.parquet")
    ds = RLHFDataset([a, b], tokenizer, prompt_key="question")
    assert texts_of(ds) == ["1+2=", "5+6="]
    assert ds[1]["ground_truth"] == "1" and ds[1]["data_source"] == DATA_SOURCE
    ds = RLHFDataset(b, tokenizer)
    assert ds[0]["raw_prompt"] == [{"role": "user", "content": "3+4="}]
    assert ds[0]["input_ids"] == [USER, DIGIT["3"], PLUS, DIGIT["4"], EQ, ASSISTANT]


def test_dataset_json_lines_tolerate_trailing_blank_lines(tmp_path, tokenizer):
    path = tmp_path / "d.json"
    path.write_text(json.dumps({"prompt": "1="}) + "\n\n\n", encoding="utf-8")
    assert len(RLHFDataset(str(path), tokenizer, require_ground_truth=False)) == 1


@pytest.mark.parametrize("lines, message", [
    (['{"prompt": "1="}', "", '{"prompt": "2="}'], r"d\.jsonl:2: empty row \(blank line\)"),
    (['{"prompt": "1="}', '{"prompt": "2="'], r"d\.jsonl:2: malformed JSON"),
    (['{"prompt": "1="}', "[1, 2]"], r"d\.jsonl:2: expected a JSON object, got list"),
    (["{}"], r"d\.jsonl:1: empty row"),
    (['{"prompt": "1="}', '{"data_source": "x"}'], r"d\.jsonl:2: missing field 'prompt'"),
    (['{"prompt": 5}'], r"d\.jsonl:1: field 'prompt' must be a string or a list of chat messages, got int"),
    (['{"prompt": [{"role": "user"}]}'], r"d\.jsonl:1: field 'prompt' message 0 has no 'content'"),
    (['{"prompt": [{"content": "1="}]}'], r"d\.jsonl:1: field 'prompt' message 0 has no 'role'"),
    (['{"prompt": ["1="]}'], r"d\.jsonl:1: field 'prompt' message 0 must be an object"),
    (['{"prompt": []}'], r"d\.jsonl:1: field 'prompt' is an empty message list"),
    (['{"prompt": "1=", "reward_model": "1"}'], r"d\.jsonl:1: field 'reward_model' must be an object, got str"),
    (['{"prompt": "1=", "extra_info": 3}'], r"d\.jsonl:1: field 'extra_info' must be an object, got int"),
    (['{"prompt": "1="}', '{"prompt": ""}'], r"d\.jsonl:2: field 'prompt' is an empty prompt"),
    (['{"prompt": [{"role": "system", "content": "1="}, {"role": "user", "content": "1="}]}'],
     r"d\.jsonl:1: the chat template failed on field 'prompt': .*got system"),
])
def test_dataset_errors_name_file_row_and_field(tmp_path, tokenizer, lines, message):
    path = _write_lines(tmp_path / "d.jsonl", lines)
    with pytest.raises(DatasetError, match=message):
        RLHFDataset(path, tokenizer, require_ground_truth=False)


@pytest.mark.parametrize("row, field", [
    ({"prompt": "1=", "data_source": DATA_SOURCE}, "reward_model.ground_truth"),
    ({"prompt": "1=", "reward_model": {"style": "rule"}}, "reward_model.ground_truth"),
    ({"prompt": "1=", "reward_model": {"ground_truth": None}}, "reward_model.ground_truth"),
])
def test_dataset_refuses_a_row_without_ground_truth(tmp_path, tokenizer, row, field):
    """verl's reward manager reads every row's ground truth; a row without one fails at load, naming
    the file and row (it used to load as None and score 0.0 silently)."""
    path = write_jsonl([_chat_row("1+1=", "2"), row], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=rf"d\.jsonl:2: missing field '{re.escape(field)}'.*reward_model\.enable"):
        RLHFDataset(path, tokenizer)
    assert RLHFDataset(path, tokenizer, require_ground_truth=False)[1]["ground_truth"] is None


def test_dataset_passes_any_ground_truth_through(tmp_path, tokenizer):
    """Lists, dicts, bools and numbers reach the reward function as stored, from JSON and from
    Parquet (whose list columns arrive as Python lists)."""
    truths = [["Paris", "paris"], {"target": ["Paris"]}, True, 72, 0.5]
    rows = [_chat_row("1=", t) for t in truths]
    for path in (write_jsonl(rows, tmp_path / "d.jsonl"), write_records(rows[:1], tmp_path / "d.parquet")):
        ds = RLHFDataset(path, tokenizer)
        got = [item["ground_truth"] for item in ds]
        assert got == truths[:len(ds)] and [type(g) for g in got] == [type(t) for t in truths[:len(ds)]]


def test_dataset_checks_data_sources_at_load(tmp_path, tokenizer):
    path = write_jsonl([_chat_row("1=", "1"), _chat_row("2=", "2", data_source="lighteval/MATH")], tmp_path / "d.jsonl")
    builtin = ("meshppo/demo_add", "openai/gsm8k")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: no built-in reward for data_source 'lighteval/MATH' \(built-in: "
                                           r"\['meshppo/demo_add', 'openai/gsm8k'\]\); set custom_reward_function\.path"):
        RLHFDataset(path, tokenizer, data_sources=builtin)
    assert len(RLHFDataset(path, tokenizer)) == 2  # any data source when a custom function scores


@pytest.mark.parametrize("truth", [72, 72.0, ["72"]])
def test_a_gsm8k_ground_truth_that_is_not_a_string_is_refused_where_the_builtin_scorer_scores(tmp_path, tokenizer,
                                                                                              truth):
    """verl's GSM8K scorer (and meshppo's, to the letter) compares the answer it extracts, a string, with the
    ground truth unconverted: a number never matches, so the row would score 0 whatever the response."""
    from rewards import BUILTIN_DATA_SOURCES, default_compute_score

    assert default_compute_score("openai/gsm8k", "#### 72", truth) == 0.0  # what training on it would give
    gsm8k = dict(data_source="openai/gsm8k")
    rows = [_chat_row("1=", "72", **gsm8k), _chat_row("1=", 3), _chat_row("1=", truth, **gsm8k)]  # demo_add: str()s
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=rf"d\.jsonl:3: field 'reward_model\.ground_truth' is "
                                           rf"{type(truth).__name__} .*, not a string: the built-in 'openai/gsm8k' "
                                           r"scorer compares .* unconverted, as verl's does"):
        RLHFDataset(path, tokenizer, data_sources=BUILTIN_DATA_SOURCES)
    assert len(RLHFDataset(path, tokenizer, data_sources=BUILTIN_DATA_SOURCES, max_samples=2, shuffle=False)) == 2
    # a custom reward function gets it as stored
    assert RLHFDataset(path, tokenizer)[2]["ground_truth"] == truth


def test_dataset_reads_a_json_file_holding_one_array(tmp_path, tokenizer):
    """`datasets` (verl's reader) takes a .json file that is one array of rows; errors number rows by position."""
    rows = [_chat_row("1+2=", "3"), _chat_row("2+2=", "4")]
    path = tmp_path / "d.json"
    path.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    ds = RLHFDataset(str(path), tokenizer)
    assert [item["ground_truth"] for item in ds] == ["3", "4"]
    assert [item["input_ids"] for item in ds] == [item["input_ids"] for item in RLHFDataset(
        write_jsonl(rows, tmp_path / "d.jsonl"), tokenizer)]
    path.write_text(json.dumps([rows[0], {"data_source": DATA_SOURCE}]), encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d\.json:2: missing field 'prompt'"):
        RLHFDataset(str(path), tokenizer)
    path.write_text(json.dumps([rows[0], 3]), encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d\.json:2: expected a JSON object \(array element 2\), got int"):
        RLHFDataset(str(path), tokenizer)
    path.write_text("[" + json.dumps(rows[0]) + ",\n{oops}]", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d\.json: malformed JSON array: .* at line 2 column 2"):
        RLHFDataset(str(path), tokenizer)


def test_json_lines_with_a_byte_order_mark_load(tmp_path, tokenizer):
    """A UTF-8 BOM before the first row (Windows editors write one; pyarrow, which verl's
    `datasets` reads JSON with, skips it) loads the same rows; a bad byte after it is still
    reported at its line and its offset in the file."""
    rows = [_chat_row("1+2=", "3"), _chat_row("2+2=", "4")]
    plain = write_jsonl(rows, tmp_path / "plain.jsonl")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + open(plain, "rb").read())
    assert read_records(bom) == read_records(plain)
    assert [item["input_ids"] for item in RLHFDataset(str(bom), tokenizer)] == \
        [item["input_ids"] for item in RLHFDataset(plain, tokenizer)]
    first = json.dumps(rows[0]).encode()
    bom.write_bytes(b"\xef\xbb\xbf" + first + b"\n\xff\n")
    with pytest.raises(DatasetError, match=rf"bom\.jsonl:2: not valid UTF-8 \(invalid start byte at byte offset "
                                           rf"{3 + len(first) + 1}\)"):
        read_records(bom)


def test_a_directory_given_as_a_data_file_is_named_so(tmp_path):
    """A Spark-style `x.parquet/` of part files is a directory, not a missing file."""
    (tmp_path / "spark.parquet").mkdir()
    with pytest.raises(DatasetError, match=r"spark\.parquet: a directory, not a dataset file; list its parquet files"):
        read_records(tmp_path / "spark.parquet")


def test_a_directory_of_any_name_is_named_so(tmp_path):
    """verl's preprocessing scripts take a dataset directory: given as a data file, it is said to be one
    (whatever its suffix; it was 'unsupported file type')."""
    (tmp_path / "gsm8k").mkdir()
    with pytest.raises(DatasetError, match=r"gsm8k: a directory, not a dataset file; list its dataset files"):
        read_records(tmp_path / "gsm8k")


def test_a_chat_template_in_the_kwargs_serves_a_tokenizer_without_one(tmp_path, tokenizer_dir):
    """verl passes data.apply_chat_template_kwargs to apply_chat_template, so a `chat_template` there
    renders the prompts of a tokenizer that has none (they were refused)."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    path = write_jsonl([_chat_row("1+2=")], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match="the tokenizer has no chat template"):
        RLHFDataset(path, tok)
    template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    ds = RLHFDataset(path, tok, apply_chat_template_kwargs={"chat_template": template})
    assert text_of(ds, 0) == "<|user|>1+2=<|assistant|>"


def test_chat_template_kwargs_reach_the_template(tmp_path, tokenizer_dir):
    """verl's data.apply_chat_template_kwargs, e.g. enable_thinking: false, are passed to the template."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
                         "{% if enable_thinking is defined and not enable_thinking %}0{% endif %}")
    path = write_jsonl([_chat_row("1+2=")], tmp_path / "d.jsonl")
    assert text_of(RLHFDataset(path, tok), 0) == "<|user|>1+2=<|assistant|>"
    ds = RLHFDataset(path, tok, apply_chat_template_kwargs={"enable_thinking": False})
    assert text_of(ds, 0) == "<|user|>1+2=<|assistant|>0"
    assert ds[0]["input_ids"] == [USER, DIGIT["1"], PLUS, DIGIT["2"], EQ, ASSISTANT, DIGIT["0"]]


def test_messages_with_typed_parts_and_tool_calls_go_to_the_template(tmp_path, tokenizer_dir):
    """verl hands the messages to the template as they are: content as a list of typed parts, or None on a
    message with tool calls."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
                         "{% elif m.content is string %}{{ m.content }}"
                         "{% else %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}]
    tool = [{"role": "user", "content": "1"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "2"}}]}]
    path = write_jsonl([_chat_row("x", prompt=parts), _chat_row("x", prompt=tool)], tmp_path / "d.jsonl")
    ds = RLHFDataset(path, tok)
    assert texts_of(ds) == ["1+2=", "12"]
    assert ds[0]["raw_prompt"] == parts
    assert text_of(RLHFDataset(path, tok, apply_chat_template=False), 0) == "1+2="


@pytest.mark.parametrize("prompt, message", [
    ([{"role": "user", "content": None}], r"field 'prompt' message 0 'content' is null on a message without 'tool_calls'"),
    ([{"role": "user", "content": ["1="]}], r"field 'prompt' message 0 'content' is a list whose items are not all objects"),
    ([{"role": "user", "content": 3}], r"field 'prompt' message 0 'content' must be a string, a list of typed parts or null, got int"),
    ([{"role": 1, "content": "1="}], r"field 'prompt' message 0 'role' must be a string, got int"),
    # (a text part whose text is not a string failed the build with a bare TypeError from joining the texts)
    ([{"role": "user", "content": "1="}, {"role": "user", "content": [{"type": "text", "text": 5}]}],
     r"field 'prompt' message 1 part 0 of type 'text' has a 'text' that is not a string: int"),
    ([{"role": "user", "content": [{"type": "text", "text": "1"}, {"text": None}]}],
     r"field 'prompt' message 0 part 1 of type 'text' has a 'text' that is not a string: NoneType"),
    (json.dumps([{"role": "user", "content": "1+1="}]),
     r"field 'prompt' is a JSON-encoded message list stored as a string; store the list itself"),
])
def test_malformed_messages_are_refused(tmp_path, tokenizer, prompt, message):
    path = write_jsonl([_chat_row("1="), _chat_row("1=", prompt=prompt)], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: " + message):
        RLHFDataset(path, tokenizer)


@pytest.mark.parametrize("prompt, message", [
    ("", r"field 'prompt' is an empty prompt \(empty or whitespace only\)"),
    (" \n\t", r"field 'prompt' is an empty prompt \(empty or whitespace only\)"),
    ([{"role": "user", "content": ""}], r"field 'prompt' has no text in any of its 1 message \(empty or whitespace only\)"),
    ([{"role": "user", "content": " \n "}], r"field 'prompt' has no text in any of its 1 message "),
    ([{"role": "user", "content": [{"type": "text", "text": "  "}]}], r"field 'prompt' has no text in any of its 1 "),
    ([{"role": "system", "content": " "}, {"role": "user", "content": ""}, {"role": "assistant", "content": "\n"},
      {"role": "user", "content": " "}], r"field 'prompt' has no text in any of its 4 messages"),
])
@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_prompts_without_text_are_refused(tmp_path, tokenizer, prompt, message, apply_chat_template):
    """Chat template tokens made an empty prompt a few tokens long: these rows trained silently on no task."""
    path = write_jsonl([_chat_row("1="), _chat_row("1=", prompt=prompt)], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: " + message):
        RLHFDataset(path, tokenizer, apply_chat_template=apply_chat_template)


def test_prompts_with_text_in_any_role_load(tmp_path, tokenizer_dir):
    """A system message before the user's, an empty user turn beside one with text, a conversation that ends in
    an assistant's tool call and its tool response, a system-only task, a role of the data's own ("human"):
    each has text, and loads as the template renders it."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = "{% for m in messages %}{{ m.role[0] }}:{{ m.content or '' }};{% endfor %}"
    prompts = [
        [{"role": "system", "content": "s"}, {"role": "user", "content": "1+2="}],
        [{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "2="}],
        [{"role": "user", "content": "1="},
         {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
         {"role": "tool", "content": ""}],
        [{"role": "system", "content": "add 1+2"}],
        [{"role": "human", "content": "3="}],
    ]
    path = write_jsonl([_chat_row("x", prompt=prompt) for prompt in prompts], tmp_path / "d.jsonl")
    assert texts_of(RLHFDataset(path, tok)) == [
        "s:s;u:1+2=;", "u:;a:a;u:2=;", "u:1=;a:;t:;", "s:add 1+2;", "h:3=;"]


def test_plain_text_prompts_that_look_like_json_stay_text(tmp_path, tokenizer):
    path = write_jsonl([_chat_row("x", prompt="[1+2]="), _chat_row("x", prompt="[]")], tmp_path / "d.jsonl")
    assert texts_of(RLHFDataset(path, tokenizer)) == ["[1+2]=", "[]"]


def test_max_samples_choose_rows_as_verl_does(tmp_path, tokenizer):
    """verl's train/val_max_samples: over all the files, before filtering; with shuffle the rows
    np.random.default_rng(seed).choice(total, size=N, replace=False) draws, in that order, else the first N."""
    import numpy as np

    a = write_jsonl([_chat_row(f"{i}=", str(i)) for i in range(6)], tmp_path / "a.jsonl")
    b = write_jsonl([_chat_row(f"{i}=", str(i)) for i in range(6, 10)], tmp_path / "b.jsonl")
    drawn = np.random.default_rng(3).choice(10, size=4, replace=False).tolist()  # verl's rl_dataset lines
    ds = RLHFDataset([a, b], tokenizer, max_samples=4, shuffle=True, seed=3)
    assert [item["ground_truth"] for item in ds] == [str(i) for i in drawn] and drawn != sorted(drawn)
    first = RLHFDataset([a, b], tokenizer, max_samples=4, shuffle=False, seed=3)
    assert [item["ground_truth"] for item in first] == ["0", "1", "2", "3"]
    for n in (-1, 0, 10, 11):
        assert len(RLHFDataset([a, b], tokenizer, max_samples=n, shuffle=True, seed=3)) == 10
    # rows left out are not read further, as in verl; errors still name a chosen row's file and line
    bad = write_jsonl([_chat_row("1=", "1"), {"prompt": "2="}], tmp_path / "bad.jsonl")
    assert len(RLHFDataset(bad, tokenizer, max_samples=1, shuffle=False)) == 1
    with pytest.raises(DatasetError, match=r"bad\.jsonl:2: missing field 'reward_model\.ground_truth'"):
        RLHFDataset([a, bad], tokenizer, max_samples=8, shuffle=False)
    with pytest.raises(ValueError, match="needs a seed"):
        RLHFDataset([a, b], tokenizer, max_samples=4, shuffle=True, seed=None)


# What `str.splitlines` splits at besides "\n" and "\r": JSON strings may hold them unescaped.
LINE_BREAKS_IN_STRINGS = "\u2028\u2029\u0085"


def test_jsonl_lines_end_only_at_newline(tmp_path, tokenizer):
    rows = [_chat_row(f"1+{c}2=", f"3{c}") for c in LINE_BREAKS_IN_STRINGS] + [_chat_row("1+1=", "2")]
    path = write_jsonl(rows, tmp_path / "d.jsonl")
    raw = (tmp_path / "d.jsonl").read_text(encoding="utf-8")
    assert all(c in raw for c in LINE_BREAKS_IN_STRINGS)  # written unescaped (ensure_ascii=False)
    assert read_records(path) == [(i, row) for i, row in enumerate(rows, start=1)]
    assert [item["ground_truth"] for item in RLHFDataset(path, tokenizer)] == [row["reward_model"]["ground_truth"]
                                                                              for row in rows]
    # A bad row after such lines is numbered by its "\n"-separated line, as is a byte that is not UTF-8.
    with open(path, "a", encoding="utf-8") as f:
        f.write("not json\n")
    with pytest.raises(DatasetError, match=r"d\.jsonl:5: malformed JSON"):
        read_records(path)
    bad = tmp_path / "b.jsonl"
    bad.write_bytes(raw.encode("utf-8") + b'{"prompt": "\xff="}\n')
    with pytest.raises(DatasetError, match=r"b\.jsonl:5: not valid UTF-8"):
        read_records(str(bad))
    # a file of old Mac line ends ("\r" alone) reads row by row
    (tmp_path / "r.jsonl").write_text('{"prompt": "1="}\r{"prompt": "2="}\r', encoding="utf-8", newline="")
    assert read_records(str(tmp_path / "r.jsonl")) == [(1, {"prompt": "1="}), (2, {"prompt": "2="})]
    # other characters `splitlines` splits at, raw between rows (not JSON whitespace): one malformed line 2
    (tmp_path / "c.jsonl").write_text('{"prompt": "1="}\n{"prompt": "2="}\x0c{"prompt": "3="}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"c\.jsonl:2: malformed JSON"):
        read_records(str(tmp_path / "c.jsonl"))


def test_dataset_names_the_file_of_unreadable_bytes(tmp_path, tokenizer):
    # Invalid UTF-8 on line 3, byte 47 (16 + 2 + 16 + 1 + 12): "\r\n" counts as one line break.
    bad = tmp_path / "d.jsonl"
    bad.write_bytes(b'{"prompt": "1="}\r\n{"prompt": "2="}\n{"prompt": "\xff="}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:3: not valid UTF-8 \(invalid start byte at byte offset 47\)"):
        RLHFDataset(str(bad), tokenizer)
    (tmp_path / "d.parquet").write_text('{"prompt": "1="}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d\.parquet: not a readable parquet file: .*magic bytes"):
        RLHFDataset(str(tmp_path / "d.parquet"), tokenizer)
    # a damaged footer: pyarrow raises a bare OSError ("Couldn't deserialize thrift") that named no row
    import pyarrow as pa
    import pyarrow.parquet as pq

    damaged = tmp_path / "damaged.parquet"
    pq.write_table(pa.table({"prompt": ["1="] * 100}), damaged)
    data = bytearray(damaged.read_bytes())
    data[-40:-8] = b"\xff" * 32  # the footer's metadata, between its length and the magic bytes
    damaged.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match=r"damaged\.parquet: not a readable parquet file: "):
        RLHFDataset(str(damaged), tokenizer)


def test_dataset_missing_file_and_bad_options(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match=r"nope\.jsonl: dataset file not found"):
        RLHFDataset(str(tmp_path / "nope.jsonl"), tokenizer)
    with pytest.raises(DatasetError, match=r"d\.csv: unsupported file type"):
        RLHFDataset(str(tmp_path / "d.csv"), tokenizer)
    path = write_jsonl([{"prompt": "1="}], tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match=r"truncation must be one of \['error', 'left', 'right', 'middle'\], got "
                                         r"'center'"):
        RLHFDataset(path, tokenizer, truncation="center")
    empty = _write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset is empty"):
        RLHFDataset(empty, tokenizer)


def test_chat_prompt_without_chat_template(tmp_path, tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = None
    path = write_jsonl([{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}, _chat_row("1+2=")],
                       tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: field 'prompt' is a list of chat messages but the "
                                           r"tokenizer has no chat template; use text prompts.*`chat_template`"):
        RLHFDataset(path, tok)
    # Without templating, the message contents are joined and tokenized as text.
    ds = RLHFDataset(path, tok, apply_chat_template=False)
    assert text_of(ds, 1) == "1+2=" and ds[1]["input_ids"] == [DIGIT["1"], PLUS, DIGIT["2"], EQ]


def test_overlong_prompts_filtered_and_logged(tmp_path, tokenizer, caplog):
    # Chat prompt lengths: 2 template tokens + content length.
    path = write_jsonl([_chat_row("1+2="), _chat_row("11+22="), _chat_row("1+1="), _chat_row("123+456=")],
                       tmp_path / "d.jsonl")
    with caplog.at_level(logging.WARNING, logger="data.dataset"):
        ds = RLHFDataset(path, tokenizer, max_prompt_length=6)
    assert ds.num_filtered == 2
    assert [item["raw_prompt"][0]["content"] for item in ds] == ["1+2=", "1+1="]
    assert [item["index"] for item in ds] == [0, 1]
    filtered_logs = [r for r in caplog.records if "filtered" in r.getMessage()]
    assert len(filtered_logs) == 1 and "filtered 2 prompt(s)" in filtered_logs[0].getMessage()

    with pytest.raises(DatasetError, match=r"dataset is empty \(2 row\(s\) filtered as longer than "
                                           r"max_prompt_length=5"):
        RLHFDataset(write_jsonl([_chat_row("11+22="), _chat_row("1+22=")], tmp_path / "e.jsonl"),
                    tokenizer, max_prompt_length=5)


def test_overlong_prompts_truncation(tmp_path, tokenizer):
    path = write_jsonl([{"prompt": "1+2=", "reward_model": {"ground_truth": "3"}},
                        {"prompt": "123+456=", "reward_model": {"ground_truth": "579"}}], tmp_path / "d.jsonl")
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: prompt is 8 tokens, longer than max_prompt_length=4"):
        RLHFDataset(path, tokenizer, max_prompt_length=4, filter_overlong_prompts=False)
    left = RLHFDataset(path, tokenizer, max_prompt_length=4, filter_overlong_prompts=False, truncation="left")
    right = RLHFDataset(path, tokenizer, max_prompt_length=4, filter_overlong_prompts=False, truncation="right")
    assert left[1]["input_ids"] == [DIGIT["4"], DIGIT["5"], DIGIT["6"], EQ]
    assert right[1]["input_ids"] == [DIGIT["1"], DIGIT["2"], DIGIT["3"], PLUS]
    assert left[0]["input_ids"] == right[0]["input_ids"] == [DIGIT["1"], PLUS, DIGIT["2"], EQ]
    assert left.num_filtered == 0 and len(left) == 2
    # verl's middle: ids[:L // 2] + ids[-(L - L // 2):], the first and last halves (the odd one at the end)
    for limit, kept in ((4, "12" + "6="), (5, "12" + "56="), (7, "123" + "456=")):
        middle = RLHFDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False,
                             truncation="middle")
        assert middle[1]["input_ids"] == [{"=": EQ}.get(c) or DIGIT[c] for c in kept]


# ---- PromptDataLoader


class _Range:
    """A stand-in dataset whose items are their own indices."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


@pytest.mark.parametrize("draws", [1, 2])
def test_loader_epochs_are_verls_seeded_permutations(draws):
    """verl's sampler (torchdata's RandomSampler over a generator seeded with data.seed) draws a
    permutation from that one generator each time its loader starts an epoch's iterator: once without
    worker processes, twice with them (the second kept). Epoch e is the generator's ((e + 1) * draws)-th
    randperm. (Checked against torchdata 0.11's StatefulDataLoader with 0, 1, 2 and 4 workers.)"""
    import torch

    loader = PromptDataLoader(_Range(10), batch_size=3, seed=5, draws_per_epoch=draws)
    assert len(loader) == 3
    epochs = [list(loader) for _ in range(3)]
    assert loader.epoch == 3
    generator = torch.Generator().manual_seed(5)
    perms = [torch.randperm(10, generator=generator).tolist() for _ in range(6)]
    for epoch, expected in zip(epochs, perms[draws - 1::draws]):
        assert epoch == [expected[0:3], expected[3:6], expected[6:9]]  # last item dropped
    assert epochs[1] != epochs[0] and epochs[2] != epochs[1]


def test_loader_resume_keeps_the_order_it_was_saved_with():
    uninterrupted = PromptDataLoader(_Range(10), batch_size=3, seed=2, draws_per_epoch=2)
    reference = [uninterrupted.next_batch() for _ in range(8)]
    first = PromptDataLoader(_Range(10), batch_size=3, seed=2, draws_per_epoch=2)
    for _ in range(4):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert state["order"] == "draws per epoch: 2"
    resumed = PromptDataLoader(_Range(10), batch_size=3, seed=2, draws_per_epoch=1)  # the option changed since
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == reference[4:]
    with pytest.raises(ValueError, match="draws_per_epoch must be 1 or 2"):
        PromptDataLoader(_Range(10), batch_size=3, draws_per_epoch=0)

    ordered = PromptDataLoader(_Range(5), batch_size=2, shuffle=False, drop_last=False)
    assert len(ordered) == 3 and list(ordered) == [[0, 1], [2, 3], [4]]
    assert [ordered.next_batch() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]


def test_loader_resume_gives_the_next_batch():
    uninterrupted = PromptDataLoader(_Range(10), batch_size=3, seed=1)
    reference = [uninterrupted.next_batch() for _ in range(8)]  # crosses two epoch boundaries

    for stop in (3, 6):  # mid-epoch, and right at an epoch boundary
        first = PromptDataLoader(_Range(10), batch_size=3, seed=1)
        for _ in range(stop):
            first.next_batch()
        state = first.state_dict()
        assert set(state) == {"epoch", "position", "size", "order"}
        resumed = PromptDataLoader(_Range(10), batch_size=3, seed=1)
        resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON checkpoint
        assert [resumed.next_batch() for _ in range(8 - stop)] == reference[stop:]
    assert first.state_dict() == {"epoch": 2, "position": 0, "size": 10, "order": "draws per epoch: 1"}


def test_loader_state_without_order_resumes_in_its_runs_per_epoch_seeded_order():
    """Checkpoints written before verl's order (no "order" in the state) resume in the order their
    run had begun: epoch e the permutation of a generator seeded with seed + e, so a resumed epoch
    neither repeats nor skips prompts; and they save that order on."""
    import torch

    loader = PromptDataLoader(_Range(10), batch_size=3, seed=5)
    loader.load_state_dict({"epoch": 1, "position": 3, "size": 10})
    old1 = torch.randperm(10, generator=torch.Generator().manual_seed(6)).tolist()
    old2 = torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist()
    assert [loader.next_batch() for _ in range(3)] == [old1[3:6], old1[6:9], old2[0:3]]
    assert loader.state_dict() == {"epoch": 2, "position": 3, "size": 10, "order": "seed + epoch"}
    with pytest.raises(ValueError, match="order must be"):
        loader.load_state_dict({"epoch": 0, "position": 0, "size": 10, "order": "shuffled"})


def test_loader_resume_with_real_dataset(tmp_path, tokenizer):
    ds = RLHFDataset(write_jsonl(make_demo_rows(20, seed=0), tmp_path / "d.jsonl"), tokenizer)
    loader = PromptDataLoader(ds, batch_size=4, seed=3)
    for _ in range(3):
        loader.next_batch()
    fourth = loader.next_batch()
    resumed = PromptDataLoader(ds, batch_size=4, seed=3)
    consumed = [batch for _, batch in zip(range(3), resumed)]  # __iter__ advances the state too
    assert len(consumed) == 3
    state = resumed.state_dict()
    assert state == {"epoch": 0, "position": 12, "size": 20, "order": "draws per epoch: 1", "data": ds.fingerprint}
    again = PromptDataLoader(ds, batch_size=4, seed=3)
    again.load_state_dict(json.loads(json.dumps(state)))
    assert again.next_batch() == fourth


def test_loader_state_of_other_rows_of_the_same_count_is_refused(tmp_path, tokenizer):
    """The files changed since the checkpoint, as many rows as before: reordered, one prompt or one answer
    edited. The position would go on over other prompts (resumed silently before); refused as a change of
    size is. The same rows read again (another file, the same content) resume."""
    rows = make_demo_rows(12, seed=0)
    ds = RLHFDataset(write_jsonl(rows, tmp_path / "d.jsonl"), tokenizer)
    loader = PromptDataLoader(ds, batch_size=4, seed=3)
    loader.next_batch()
    state = json.loads(json.dumps(loader.state_dict()))
    again = RLHFDataset(write_jsonl(rows, tmp_path / "same.jsonl"), tokenizer)
    PromptDataLoader(again, batch_size=4, seed=3).load_state_dict(state)
    edited_prompt = [dict(r) for r in rows]
    edited_prompt[7] = {**rows[7], "prompt": rows[8]["prompt"]}
    edited_answer = [dict(r) for r in rows]
    edited_answer[2] = {**rows[2], "reward_model": {"ground_truth": "1234"}}
    for name, changed in (("reordered", rows[1:] + rows[:1]), ("prompt", edited_prompt), ("answer", edited_answer)):
        other = RLHFDataset(write_jsonl(changed, tmp_path / f"{name}.jsonl"), tokenizer)
        assert len(other) == len(ds) and other.fingerprint != ds.fingerprint, name
        with pytest.raises(ValueError, match=r"other prompts or answers .* as many \(12\) but not the same"):
            PromptDataLoader(other, batch_size=4, seed=3).load_state_dict(state)


def test_loader_errors():
    with pytest.raises(ValueError, match=r"batch_size=11 is larger than the dataset \(10 prompts\)"):
        PromptDataLoader(_Range(10), batch_size=11)
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        PromptDataLoader(_Range(10), batch_size=0)
    with pytest.raises(ValueError, match="invalid data loader state"):
        PromptDataLoader(_Range(10), batch_size=2).load_state_dict({"epoch": 0, "position": 11})


def test_loader_state_of_another_dataset_size_is_refused():
    """A position saved over 10 prompts does not fit 8 or 12 (the shuffled order is another, so
    batches would repeat or skip prompts); a state from before the size was saved still loads."""
    saved = PromptDataLoader(_Range(10), batch_size=2, seed=1)
    saved.next_batch()
    state = saved.state_dict()
    for n in (8, 12):
        loader = PromptDataLoader(_Range(n), batch_size=2, seed=1)
        with pytest.raises(ValueError, match=f"its run trained on 10 prompts, and data.train_files .* now give {n}"):
            loader.load_state_dict(state)
        assert loader.state_dict() == {"epoch": 0, "position": 0, "size": n, "order": "draws per epoch: 1"}  # unchanged
    old = PromptDataLoader(_Range(10), batch_size=2, seed=1)
    old.load_state_dict({"epoch": 0, "position": 2})  # epoch 0 is the same permutation in both orders
    assert old.next_batch() == saved.next_batch()


# ---- GSM8K converter


GSM8K_SAMPLE = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs $1,200 plus $300 tax. Total?", "answer": "1200+300=1500\n#### 1,500"},
]


@pytest.mark.parametrize("in_ext, out_ext", [("jsonl", "jsonl"), ("parquet", "parquet")])
def test_gsm8k_conversion(tmp_path, in_ext, out_ext):
    src = write_records(GSM8K_SAMPLE, tmp_path / f"in.{in_ext}")
    dst = str(tmp_path / f"out.{out_ext}")
    assert gsm8k_main(["--input", src, "--output", dst, "--split", "test"]) == 0
    rows = [row for _, row in read_records(dst)]
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many? "
                                               "Let's think step by step and output the final answer after \"####\"."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "test", "index": 0, "answer": GSM8K_SAMPLE[0]["answer"],
                       "question": GSM8K_SAMPLE[0]["question"]},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "1500" and rows[1]["extra_info"]["index"] == 1
    assert rows[1]["prompt"][0]["content"].endswith(INSTRUCTION)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_gsm8k_multiturn_rows_are_verls_tool_rows(tmp_path, ext):
    """--multiturn writes the rows of verl's gsm8k_multiturn_w_tool.py, nested kwargs surviving the file."""
    src = write_records(GSM8K_SAMPLE, tmp_path / f"in.{ext}")
    dst = str(tmp_path / f"out.{ext}")
    assert gsm8k_main(["--input", src, "--output", dst, "--split", "test", "--multiturn"]) == 0
    rows = [row for _, row in read_records(dst)]
    query = ("A car costs $1,200 plus $300 tax. Total? "
             "Let's think step by step and output the final answer after `####`.")
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": (
                "You are a math expert. You are given a question and you need to solve it step by step. "
                "Reasoning step by step before any tool call. You should use the `calc_gsm8k_reward` tool after "
                "step by step solving the question, before generate final answer at least once and refine your "
                "answer if necessary. Put your final answer in the format of `#### <answer>`.")},
            {"role": "user", "content": query},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1500"},
        "extra_info": {
            "split": "test", "index": 1, "answer": GSM8K_SAMPLE[1]["answer"], "question": GSM8K_SAMPLE[1]["question"],
            "need_tools_kwargs": True,
            "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1500"}}},
            "interaction_kwargs": {"query": query, "ground_truth": "1500"},
        },
    }
    assert rows[0]["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "7"}


def test_gsm8k_multiturn_is_only_added_fields(tmp_path):
    """The tool row differs from the single-turn one only in the prompt and the added extra_info keys."""
    from data.gsm8k import convert_row

    single = convert_row(GSM8K_SAMPLE[0], 3, "train")
    multi = convert_row(GSM8K_SAMPLE[0], 3, "train", multiturn="tool")
    assert {k: v for k, v in multi.items() if k not in ("prompt", "extra_info")} == \
        {k: v for k, v in single.items() if k not in ("prompt", "extra_info")}
    added = set(multi["extra_info"]) - set(single["extra_info"])
    assert added == {"need_tools_kwargs", "tools_kwargs", "interaction_kwargs"}
    assert {k: multi["extra_info"][k] for k in single["extra_info"]} == single["extra_info"]


def test_gsm8k_multiturn_rows_feed_the_dataset_with_their_tools_kwargs(tmp_path, tokenizer_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = "{% for m in messages %}<|{{ 'assistant' if m['role'] == 'system' else 'user' }}|>" \
                        "{% endfor %}<|assistant|>"
    dst = str(tmp_path / "out.jsonl")
    assert convert_file(write_records(GSM8K_SAMPLE, tmp_path / "in.jsonl"), dst, multiturn="tool") == 2
    ds = RLHFDataset(dst, tok)
    assert text_of(ds, 0) == "<|assistant|><|user|><|assistant|>"
    assert ds[1]["extra_info"]["tools_kwargs"] == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1500"}}}


def test_parquet_rows_naming_different_tools_load_each_with_its_own(tmp_path, tokenizer):
    """pyarrow stores the rows' `extra_info.tools_kwargs` as one struct of every row's tools, so a row
    reads None for a tool only another row names: those are left out of the row's tools_kwargs (they
    were refused as not an object)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_chat_row("1+1=", "2", agent_name="tool_agent",
                      extra_info={"tools_kwargs": {"calc": {"create_kwargs": {"ground_truth": "2"}}}}),
            _chat_row("2+2=", "4", agent_name="tool_agent",
                      extra_info={"tools_kwargs": {"search": {"create_kwargs": {"query": "four"}}}})]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert read_records(path)[0][1]["extra_info"]["tools_kwargs"]["search"] is None  # what pyarrow gives
    ds = RLHFDataset([path], tokenizer)
    assert ds[0]["tools_kwargs"] == {"calc": {"create_kwargs": {"ground_truth": "2"}}}
    assert ds[1]["tools_kwargs"] == {"search": {"create_kwargs": {"query": "four"}}}
    # a value that is not an object is still refused
    bad = str(tmp_path / "bad.jsonl")
    write_jsonl([_chat_row("1+1=", "2", agent_name="tool_agent", extra_info={"tools_kwargs": {"calc": 3}})], bad)
    with pytest.raises(DatasetError, match=r"bad.jsonl:1: field 'extra_info.tools_kwargs' must map each tool's name"):
        RLHFDataset([bad], tokenizer)


def _tool_schemas(*names):
    return [{"type": "function", "function": {"name": name, "description": f"the {name} tool"}} for name in names]


def test_a_tool_agent_row_s_prompt_shows_the_tools_of_its_tool_selection(tmp_path):
    """verl 0.9.1 renders a tool_agent row's prompt with the schemas of its `extra_info.tool_selection`
    only, in the selection's order (each once); an empty or null one means all the tools. Other rows'
    loop never reads the field (verl's single-turn loop neither): loaded as they are, without tools."""
    from tests.byte_chat import build_byte_tokenizer

    tok = build_byte_tokenizer()
    calc, search, clock = schemas = _tool_schemas("calc", "search", "clock")
    selections = [["clock", "calc"], ["search", "search"], [], None]
    rows = [_chat_row(f"{i}+1=", agent_name="tool_agent", extra_info={"tool_selection": selection})
            for i, selection in enumerate(selections)]
    rows.append(_chat_row("9+1=", extra_info={"tool_selection": "calc"}))  # single_turn_agent: not read
    path = str(tmp_path / "d.jsonl")
    write_jsonl(rows, path)
    ds = RLHFDataset([path], tok, tool_schemas=schemas)

    def rendered(row, tools):
        return tok.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)

    for i, tools in enumerate([[clock, calc], [search], schemas, schemas]):
        assert ds[i]["input_ids"] == rendered(rows[i], tools), i
    assert ds[4]["input_ids"] == rendered(rows[4], None)
    assert '"clock"' in text_of(ds, 0) and '"search"' not in text_of(ds, 0)
    assert [ds[i]["tool_selection"] for i in range(5)] == [["clock", "calc"], ["search"], None, None, None]


@pytest.mark.parametrize("selection, tools, message", [
    ("calc", ("calc", "search"), r"must be a list of tool names \(strings\), got 'calc'"),
    (["calc", 3], ("calc", "search"), r"must be a list of tool names \(strings\), got \['calc', 3\]"),
    ({"calc": True}, ("calc", "search"), r"must be a list of tool names"),
    (["calc", "serch"], ("calc", "search"), r"names 'serch', which is not a tool of "
     r"actor_rollout_ref\.rollout\.multi_turn\.tool_config_path \(its tools: \['calc', 'search'\]\)"),
    (["calc"], (), r"names 'calc', which is not a tool of .*\(its tools: \[\]\)"),
])
def test_a_bad_tool_selection_is_refused_at_load_naming_the_row(tmp_path, tokenizer, selection, tools, message):
    """verl drops a selected name it has no tool of; meshppo refuses it (and a selection that is not a
    list of names) at load, naming the file:row and the field."""
    bad = str(tmp_path / "bad.jsonl")
    write_jsonl([_chat_row("1+1=", "2", agent_name="tool_agent"),
                 _chat_row("2+2=", "4", agent_name="tool_agent", extra_info={"tool_selection": selection})], bad)
    with pytest.raises(DatasetError, match=r"bad.jsonl:2: field 'extra_info.tool_selection' " + message):
        RLHFDataset([bad], tokenizer, tool_schemas=_tool_schemas(*tools))


def test_parquet_rows_with_and_without_a_tool_selection(tmp_path, tokenizer):
    """pyarrow gives a row without the field None (all the tools) and a selection as a list."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_chat_row("1+1=", "2", agent_name="tool_agent", extra_info={"tool_selection": ["search"]}),
            _chat_row("2+2=", "4", agent_name="tool_agent", extra_info={"other": 1})]
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    ds = RLHFDataset([path], tokenizer, tool_schemas=_tool_schemas("calc", "search"))
    assert [ds[0]["tool_selection"], ds[1]["tool_selection"]] == [["search"], None]


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_gsm8k_interaction_rows_are_verls_interaction_rows(tmp_path, ext):
    """--multiturn interaction writes the rows of verl's gsm8k_multiturn_w_interaction.py."""
    src = write_records(GSM8K_SAMPLE, tmp_path / f"in.{ext}")
    dst = str(tmp_path / f"out.{ext}")
    assert gsm8k_main(["--input", src, "--output", dst, "--split", "test", "--multiturn", "interaction"]) == 0
    rows = [row for _, row in read_records(dst)]
    query = ("A car costs $1,200 plus $300 tax. Total? "
             "Let's think step by step and output the final answer after `####`.")
    assert rows[1] == {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": (
                "You are a math expert. You are given a question and you need to solve it step by step. "
                "You should rethinking carefully if user point out your answer is wrong. "
                "Put your final answer in the format of `#### <answer>`.")},
            {"role": "user", "content": query},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1500"},
        "extra_info": {
            "split": "test", "index": 1, "answer": GSM8K_SAMPLE[1]["answer"], "question": GSM8K_SAMPLE[1]["question"],
            "interaction_kwargs": {"name": "gsm8k", "query": query, "ground_truth": "1500"},
        },
    }
    assert rows[0]["extra_info"]["interaction_kwargs"]["ground_truth"] == "7"
    assert list(rows[1]["extra_info"]) == ["split", "index", "answer", "question", "interaction_kwargs"]


def test_gsm8k_interaction_rows_differ_from_the_tool_rows_in_system_prompt_and_kwargs():
    from data.gsm8k import convert_row

    tool = convert_row(GSM8K_SAMPLE[0], 3, "train", multiturn="tool")
    inter = convert_row(GSM8K_SAMPLE[0], 3, "train", multiturn="interaction")
    assert inter["prompt"][1] == tool["prompt"][1] and inter["prompt"][0] != tool["prompt"][0]
    assert {k: v for k, v in inter.items() if k not in ("prompt", "extra_info")} == \
        {k: v for k, v in tool.items() if k not in ("prompt", "extra_info")}
    assert inter["extra_info"]["interaction_kwargs"] == {"name": "gsm8k", **tool["extra_info"]["interaction_kwargs"]}
    assert set(tool["extra_info"]) - set(inter["extra_info"]) == {"need_tools_kwargs", "tools_kwargs"}


def test_gsm8k_multiturn_option_values(tmp_path, capsys):
    """A bare --multiturn still means the tool rows; an unknown kind is refused by the CLI and the API."""
    from data.gsm8k import convert_row

    src = write_records(GSM8K_SAMPLE, tmp_path / "in.jsonl")
    bare, tool = str(tmp_path / "bare.jsonl"), str(tmp_path / "tool.jsonl")
    assert gsm8k_main(["--input", src, "--multiturn", "--output", bare]) == 0
    assert gsm8k_main(["--input", src, "--output", tool, "--multiturn", "tool"]) == 0
    assert list(read_records(bare)) == list(read_records(tool))
    assert "tools_kwargs" in read_records(bare)[0][1]["extra_info"]
    with pytest.raises(SystemExit) as exit_info:
        gsm8k_main(["--input", src, "--output", str(tmp_path / "x.jsonl"), "--multiturn", "user"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'user'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"multiturn must be None or one of \['tool', 'interaction'\], got True"):
        convert_row(GSM8K_SAMPLE[0], 0, "train", multiturn=True)
    with pytest.raises(ValueError, match=r"got 'user'"):
        convert_file(src, str(tmp_path / "y.jsonl"), multiturn="user")
    assert not (tmp_path / "y.jsonl").exists()


def test_gsm8k_converted_file_feeds_the_dataset(tmp_path, tokenizer):
    dst = str(tmp_path / "out.jsonl")
    assert convert_file(write_records(GSM8K_SAMPLE, tmp_path / "in.jsonl"), dst) == 2
    ds = RLHFDataset(dst, tokenizer, max_prompt_length=1000)
    assert [item["ground_truth"] for item in ds] == ["7", "1500"]
    assert text_of(ds, 0).startswith("<|user|>Tom has 3") and ds[0]["data_source"] == "openai/gsm8k"


@pytest.mark.parametrize("answer, ground_truth", [
    ("3 * 24 = 72\n#### 72", "72"),
    ("#### 1,000", "1000"),       # commas removed, as the scorer removes them from responses
    ("It costs $18.\n#### $18", "18"),
    ("#### 18.", "18"),           # a sentence's full stop is no part of the number
    ("#### -3\n", "-3"),
    ("#### 2.5", "2.5"),
    ("#### 1 and then\n#### 1,234.50.", "1234.50"),
])
def test_gsm8k_ground_truth_is_the_final_number(answer, ground_truth):
    from data.gsm8k import convert_row
    from rewards.gsm8k import compute_score

    row = convert_row({"question": "q", "answer": answer}, 0, "train")
    assert row["reward_model"]["ground_truth"] == ground_truth
    # The scorer gives a correct response full marks against what the converter wrote.
    truth = row["reward_model"]["ground_truth"]
    assert compute_score(f"so #### {ground_truth}", truth) == 1.0
    assert compute_score(f"the answer is {ground_truth}", truth, method="flexible") == 1.0


@pytest.mark.parametrize("row, message", [
    ({"question": "q"}, r"in\.jsonl:2: missing field 'answer'"),
    ({"question": 3, "answer": "#### 1"}, r"in\.jsonl:2: field 'question' must be a string, got int"),
    ({"question": "q", "answer": "the answer is 4"}, r"in\.jsonl:2: field 'answer' does not end with '#### <number>'"),
    ({"question": "q", "answer": "#### 3/4"},
     r"in\.jsonl:2: field 'answer' does not end with '#### <number>': '#### 3/4'"),
    ({"question": "q", "answer": "#### 7 apples"}, r"in\.jsonl:2: field 'answer' does not end with '#### <number>'"),
    ({"question": "q", "answer": "#### 7\nso 8"}, r"in\.jsonl:2: field 'answer' does not end with '#### <number>'"),
])
def test_gsm8k_malformed_rows(tmp_path, capsys, row, message):
    src = write_jsonl([GSM8K_SAMPLE[0], row], tmp_path / "in.jsonl")
    with pytest.raises(DatasetError, match=message):
        convert_file(src, str(tmp_path / "out.jsonl"))
    with pytest.raises(SystemExit) as exit_info:
        gsm8k_main(["--input", src, "--output", str(tmp_path / "out.jsonl")])
    assert exit_info.value.code == 1
    assert "in.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "out.jsonl").exists()


def _gsm8k_bad_input(tmp_path, case):
    """(input, output, expected error) for one way `python -m data.gsm8k` used to crash or lose data."""
    good = write_jsonl(GSM8K_SAMPLE, tmp_path / "in.jsonl")
    out = str(tmp_path / "out.jsonl")
    if case == "not parquet":
        src = tmp_path / "in.parquet"
        src.write_text(json.dumps(GSM8K_SAMPLE[0]) + "\n", encoding="utf-8")
        return str(src), out, r"in\.parquet: not a readable parquet file: "
    if case == "bad utf-8":
        src = tmp_path / "bad.jsonl"
        src.write_bytes(json.dumps(GSM8K_SAMPLE[0]).encode() + b'\n{"question": "\xe9", "answer": "#### 1"}\n')
        return str(src), out, r"bad\.jsonl:2: not valid UTF-8 "
    if case == "output under a file":
        (tmp_path / "afile").write_text("x")
        return good, str(tmp_path / "afile" / "sub" / "out.jsonl"), (
            r"out\.jsonl: cannot write the output: .*afile is not a directory")
    if case == "output is the input":
        return good, str(tmp_path / "." / "in.jsonl"), r"in\.jsonl: the output is the input file"
    if case == "unsupported output type":
        return good, str(tmp_path / "out.csv"), r"out\.csv: unsupported file type"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["not parquet", "bad utf-8", "output under a file", "output is the input",
                                  "unsupported output type"])
def test_gsm8k_cli_file_errors_are_one_line(tmp_path, capsys, case):
    src, dst, message = _gsm8k_bad_input(tmp_path, case)
    before = open(src, "rb").read()
    with pytest.raises(DatasetError, match=message):
        convert_file(src, dst)
    with pytest.raises(SystemExit) as exit_info:
        gsm8k_main(["--input", src, "--output", dst])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1
    assert re.search(message, err)
    assert open(src, "rb").read() == before  # the input is never touched


def test_gsm8k_failed_write_keeps_the_old_output(tmp_path, monkeypatch):
    """The rows go to a temporary file renamed into place: a write that fails half-way leaves
    the previous output whole, and no temporary file behind."""
    import data.gsm8k

    src = write_jsonl(GSM8K_SAMPLE, tmp_path / "in.jsonl")
    dst = tmp_path / "out.jsonl"
    dst.write_text("previous\n", encoding="utf-8")

    def write_half_then_fail(rows, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(rows[0]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(data.gsm8k, "write_records", write_half_then_fail)
    with pytest.raises(DatasetError, match=r"out\.jsonl: cannot write the output: No space left on device"):
        convert_file(src, str(dst))
    assert dst.read_text(encoding="utf-8") == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def _byte_level_bpe():
    """A small trained byte-level BPE (Qwen's kind of tokenizer), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Natalia sold 48 clips in April , and half as many in May .", "héllo wörld ! 12+30=42"] * 4,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                                clean_up_tokenization_spaces=False)


def _words_with_clean_up():
    """A word-level tokenizer whose decoding joins words with spaces, with transformers' clean-up
    on: `batch_decode` turns "sold 48 clips ." into "sold 48 clips." where the backend alone does not."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_end|>", "sold", "48", "clips", ".", ",", "and", "?", "May"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]",
                                                clean_up_tokenization_spaces=True)


@pytest.mark.parametrize("kind", ["demo", "bpe", "clean_up"])
def test_decode_batch_gives_batch_decode_strings(kind, tokenizer_dir):
    """`models.tokenizer.decode_batch` (the backend's batch decode where that is all transformers
    would do) returns exactly `batch_decode`'s strings: special tokens inside and at the ends,
    empty sequences, non-ASCII bytes split over tokens, with and without skipping specials; a
    tokenizer with clean-up, whose strings the backend alone would get wrong, included."""
    from models.tokenizer import decode_batch, load_tokenizer

    texts = {"demo": ["<|user|>12+3=<|assistant|>15<|eos|>", "9 - 4*0<|pad|><|pad|>", ""],
             "bpe": ["Natalia sold 48 clips , and héllo<|im_end|>", "<|endoftext|>wörld !", "", "April . May ?"],
             "clean_up": ["sold 48 clips , and May ?", "clips .<|im_end|>", ""]}[kind]
    tok = {"demo": lambda: load_tokenizer(tokenizer_dir), "bpe": _byte_level_bpe, "clean_up": _words_with_clean_up}[kind]()
    seqs = [tok(t)["input_ids"] for t in texts] + [[]]
    seqs.append([i for s in seqs for i in s][::-1][:7])  # ids out of any natural order (partial UTF-8 too)
    for skip in (True, False):
        assert decode_batch(tok, seqs, skip_special_tokens=skip) == tok.batch_decode(seqs, skip_special_tokens=skip)
    if kind == "clean_up":  # the case is only a test if the backend alone differs
        assert tok.backend_tokenizer.decode_batch(seqs, skip_special_tokens=True) != tok.batch_decode(
            seqs, skip_special_tokens=True)
    assert decode_batch(tok, [], skip_special_tokens=True) == []


def test_prompts_are_tokenized_in_chunks_with_the_same_ids(tmp_path, tokenizer, monkeypatch):
    """A dataset's prompts are tokenized TOKENIZE_CHUNK at a time (100k prompts' encodings at once held
    2 GB more after the build): chunks of 3 over 8 rows, chat and plain prompts mixed, give every row the
    ids a single call gives, in the rows' order."""
    import data.dataset as dataset_module

    rows = [_chat_row(f"{i}+{i}=") if i % 3 else {"prompt": f"plain {i}", "reward_model": {"ground_truth": "1"},
                                                  "data_source": "meshppo/demo_add"} for i in range(8)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    whole = [item["input_ids"] for item in RLHFDataset(str(path), tokenizer, max_prompt_length=64)]
    monkeypatch.setattr(dataset_module, "TOKENIZE_CHUNK", 3)
    chunked = [item["input_ids"] for item in RLHFDataset(str(path), tokenizer, max_prompt_length=64)]
    assert chunked == whole and len(set(map(tuple, whole))) == 8


def test_a_prompts_ids_cost_four_bytes_a_token_to_keep(tmp_path):
    """Every prompt's ids stay in memory for the whole run, on every rank: kept as lists of Python ints
    they cost 36 bytes a token above id 256 (an 8-byte pointer and a 28-byte int; 100k GSM8K-shaped
    prompts held 1.2 GB), as int32 arrays 4. The dataset's retained memory a token (tracemalloc), with
    prompts of 200 words whose raw text costs ~5 bytes a token, stays under 20 bytes (~6 measured);
    the items still hand out lists of the same ids."""
    import tracemalloc

    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "<|im_end|>"] + [f"w{i}" for i in range(1000)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", unk_token="[UNK]")
    rows = [{"prompt": " ".join(f"w{300 + (7 * i + 13 * j) % 700}" for j in range(200)), "data_source": "d",
             "reward_model": {"ground_truth": "1"}} for i in range(500)]

    def retained_by(count: int):
        """The dataset of the first `count` rows, and the memory its building left allocated."""
        path = tmp_path / f"rows{count}.jsonl"
        write_jsonl(rows[:count], str(path))
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            built = RLHFDataset(str(path), tok, max_prompt_length=256, apply_chat_template=False)
            return built, tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()

    # The cost a token is the slope between two sizes: what the first build allocates once (lazily
    # imported modules, caches; more when this test runs alone) is in both and cancels.
    small, retained_small = retained_by(100)
    dataset, retained = retained_by(500)
    per_token = (retained - retained_small) / (400 * 200)
    assert per_token < 20, f"{per_token:.1f} bytes a token"
    item = dataset[5]
    assert type(item["input_ids"]) is list and item["input_ids"] == tok(rows[5]["prompt"])["input_ids"]
    assert min(item["input_ids"]) >= 302


def test_a_drawn_subset_reads_only_its_parquet_rows_and_equals_the_full_read(tmp_path, monkeypatch):
    """max_samples drew its rows after every row of every file had become a Python object (50k of 500k
    rows: 3 GB and 5 s per rank more than the 50k). Parquet rows are now counted from the metadata and
    only the drawn ones converted; the rows, their order and their FILE:ROW names are those of
    `select_rows` over every file's records, with shuffle or without, parquet and JSON lines mixed."""
    import data.dataset as dataset_module
    from data.dataset import chosen_records, select_rows

    files = []
    for k, kind in enumerate(("parquet", "jsonl", "parquet")):
        rows = [{"prompt": f"{k}:{i}=", "data_source": "d", "reward_model": {"ground_truth": str(i)}}
                for i in range(7 + k)]
        path = tmp_path / f"part{k}.{kind}"
        write_records(rows, str(path))
        files.append(str(path))
    everything = [(f"{path}:{n}", row) for path in files for n, row in read_records(path)]
    converted = []
    real = dataset_module._parquet_records
    monkeypatch.setattr(dataset_module, "_parquet_records",
                        lambda path, only=None: converted.append(len(real(path, only))) or real(path, only))
    for max_samples, shuffle in ((5, True), (12, True), (5, False), (0, True), (100, True)):
        converted.clear()
        got = chosen_records(files, max_samples, shuffle, seed=3)
        assert got == select_rows(everything, max_samples, shuffle, 3), (max_samples, shuffle)
        if 0 < max_samples < len(everything):
            assert 0 < sum(converted) <= max_samples, converted  # the drawn parquet rows alone


def test_a_parquet_file_is_decoded_a_batch_of_rows_at_a_time(tmp_path):
    """Arrow's allocator keeps the memory it frees for reuse: a parquet file decoded whole (`read_table`)
    left about its decoded size in every rank's process for the whole run (100k GSM8K-shaped rows: ~300
    MB). Its rows are decoded `PARQUET_BATCH_ROWS` at a time: Arrow's high-water mark while
    `read_records` reads (a fresh process, so the mark is the read's) stays well under the decoded
    table's size, and every row comes back, in order, numbered as before."""
    import subprocess
    import sys

    import pyarrow.parquet as pq

    from data.dataset import PARQUET_BATCH_ROWS

    count = 32 * PARQUET_BATCH_ROWS  # one row group (pyarrow's default for a file this size)
    rows = [_chat_row(f"question {i}: " + "word " * 120, answer=str(i), extra_info={"index": i}) for i in range(count)]
    path = write_records(rows, tmp_path / "d.parquet")
    decoded = pq.read_table(path).nbytes
    script = ("import sys, pyarrow as pa\nfrom data import read_records\nrecords = read_records(sys.argv[1])\n"
              "assert [n for n, _ in records] == list(range(1, len(records) + 1))\n"
              "print(len(records), records[-1][1]['extra_info']['index'], pa.default_memory_pool().max_memory())")
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", script, str(path)], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    read, last, peak = map(int, out.stdout.split())
    assert (read, last) == (count, count - 1)
    # (decoded whole: 1.26 x the table's size; a batch at a time 0.37 x, most of it the compressed column chunks)
    assert peak < decoded / 2, (peak, decoded)
