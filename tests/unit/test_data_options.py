"""verl's `data.*` options as meshppo's dataset and config read them, where they differ from a plain pass-through."""

from __future__ import annotations

import os

import pytest
import transformers

from data import DatasetError, RLHFDataset, write_records
from data.dataset import RENDERING_ARGS
from data.demo import DATA_SOURCE, build_demo_tokenizer
from trainer.config import PPOConfig, validate
from trainer.configlib import ConfigError, load_config

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "demo.yaml")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_demo_tokenizer(out)
    return transformers.AutoTokenizer.from_pretrained(out)


def _one_row(tmp_path) -> str:
    return write_records([{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": "1+1="}],
                           "reward_model": {"ground_truth": "2"}}], tmp_path / "rows.jsonl")


@pytest.mark.parametrize("name, value", [("tokenize", True), ("add_generation_prompt", False), ("tools", []),
                                         ("continue_final_message", True), ("conversation", [])])
def test_chat_template_kwargs_that_the_rendering_sets_are_refused_naming_the_option(tmp_path, tokenizer, name, value):
    """`tokenize` and `add_generation_prompt` failed each row as a bad row (a keyword given twice), and `tools` was
    rendered into single-turn prompts and replaced for tool_agent rows; verl 0.9.1's renderer fails on all three at
    its first rollout. Refused before any row, naming the option: in the dataset, and in the config's check."""
    assert name in RENDERING_ARGS
    with pytest.raises(ValueError, match=rf"^apply_chat_template_kwargs sets {name}: the rendering of a prompt "):
        RLHFDataset(_one_row(tmp_path), tokenizer, apply_chat_template_kwargs={"enable_thinking": False, name: value})
    cfg = load_config(PPOConfig, DEMO, [f"data.apply_chat_template_kwargs={{{name}: {str(value).lower()}}}"])
    with pytest.raises(ConfigError, match=rf"^data.apply_chat_template_kwargs sets {name}: "):
        validate(cfg, 2, 2)


def test_other_chat_template_kwargs_reach_the_template(tmp_path, tokenizer):
    """Keywords the rendering does not set pass (a template given in them renders the prompt), in the config too."""
    ds = RLHFDataset(_one_row(tmp_path), tokenizer, apply_chat_template_kwargs={
        "chat_template": "{{ messages[0]['content'] }} 0", "return_dict": True})
    assert tokenizer.decode(ds[0]["input_ids"]) == "1+1= 0"
    validate(load_config(PPOConfig, DEMO, ["data.apply_chat_template_kwargs={enable_thinking: false}"]), 2, 2)


@pytest.mark.parametrize("value, media", [(0, False), (False, False), ("", False), ([], False), ({}, False),
                                          (1, True), (True, True), (2.5, True), ("a.png", True), ([{"image": "a"}], True)])
def test_a_media_field_of_any_value_is_read_as_verl_reads_it(tmp_path, tokenizer, value, media):
    """A row's images / videos / audios field is media where verl's `row.get(key) or []` finds some: an empty or
    false value (0, false, "", [], {}) is none and the row loads; any other value is refused naming the row and the
    field. A number or a flag failed the build with a bare `TypeError: object of type 'int' has no len()`."""
    row = {"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": "1+1="}],
           "reward_model": {"ground_truth": "2"}, "videos": value}
    path = write_records([row], tmp_path / "rows.jsonl")
    if media:
        with pytest.raises(DatasetError, match=r"rows.jsonl:1: field 'videos' holds media: meshppo's models are text"):
            RLHFDataset(path, tokenizer)
    else:
        assert RLHFDataset(path, tokenizer)[0]["raw_prompt"] == row["prompt"]
