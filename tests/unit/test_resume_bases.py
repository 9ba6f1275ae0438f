"""A resume identifies the model directories its run read by what they hold, not by their path.

It compared `actor_rollout_ref.model.path` (and the other model paths) as strings: a LoRA run,
whose checkpoints hold the adapters only and re-read the base from the path, resumed silently
onto other base weights at the same path (a full fine-tune's reference model the same), while
the same files reached through a link or a relative path from another directory were refused
as other training settings, whose only remedy offered (resume_mode=disable) deletes the run's
checkpoints."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_checkpoint_state import _Counter
from trainer.checkpointing import STATE_FILE, CheckpointManager
from trainer.config import PPOConfig
from trainer.configlib import build_dataclass
from trainer.errors import UserError


def _model_dir(path, seed=0):
    """A model directory: config.json and weights (the same shapes for every seed)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "hidden_size": 64}, f)
    g = torch.Generator().manual_seed(seed)
    save_file({"model.embed_tokens.weight": torch.randn(512, 64, generator=g),
               "lm_head.weight": torch.randn(512, 64, generator=g)}, os.path.join(path, "model.safetensors"))
    return str(path)


def _manager(root, model_path, said=None):
    # resolved as a run's: data.tokenizer, critic.model.path and reward_model.model.input_tokenizer the model path
    cfg = build_dataclass(PPOConfig, {"actor_rollout_ref": {"model": {"path": model_path}}})
    assert cfg.data.tokenizer == cfg.critic.model.path == cfg.reward_model.model.input_tokenizer == model_path
    counter = _Counter()
    return CheckpointManager(str(root), states={"trainer": counter}, fingerprint={}, config=cfg,
                             log=(said.append if said is not None else lambda s: None)), counter


def _saved(tmp_path, model_path):
    manager, counter = _manager(tmp_path / "ckpt", model_path)
    counter.step = 3
    return manager.save(3)


def test_other_base_weights_at_the_same_path_are_refused_before_anything_loads(tmp_path):
    base = _model_dir(tmp_path / "base")
    step = _saved(tmp_path, base)
    _model_dir(base, seed=1)  # the same path and shapes, other weights
    resumed, counter = _manager(tmp_path / "ckpt", base)
    with pytest.raises(UserError) as e:
        resumed.maybe_resume("auto")
    msg = str(e.value)
    assert "\n" not in msg and f"actor_rollout_ref.model.path={base!r}" in msg and "model.safetensors" in msg
    assert "config.json" not in msg  # only what changed is named
    assert counter.step == 0 and os.path.isfile(os.path.join(step, STATE_FILE))  # nothing loaded, nothing deleted


def test_a_changed_config_at_the_same_path_is_refused(tmp_path):
    base = _model_dir(tmp_path / "base")
    _saved(tmp_path, base)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "hidden_size": 64, "rms_norm_eps": 1e-5}, f)
    with pytest.raises(UserError, match=r"config\.json differ"):
        _manager(tmp_path / "ckpt", base)[0].maybe_resume("auto")


def test_the_same_files_through_a_link_a_relative_path_or_a_copy_resume(tmp_path, monkeypatch):
    base = _model_dir(tmp_path / "models" / "base")
    _saved(tmp_path, base)
    os.symlink(tmp_path / "models", tmp_path / "link")
    shutil.copytree(base, tmp_path / "copy")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for spelled in (str(tmp_path / "link" / "base"), os.path.join("..", "models", "base"), str(tmp_path / "copy")):
        said = []
        resumed, counter = _manager(tmp_path / "ckpt", spelled, said)
        assert resumed.maybe_resume("auto") == resumed.step_dir(3) and counter.step == 3, spelled
        # the same directory is not said to have moved; the copy is, with how it was compared
        moved = [s for s in said if " moved from " in s]
        assert moved == ([] if "copy" not in spelled else [
            f"checkpoint {resumed.step_dir(3)}: actor_rollout_ref.model.path, data.tokenizer, critic.model.path, "
            f"reward_model.model.input_tokenizer moved from {base!r} to {spelled!r}; resumed because its files match "
            "what the run read there, compared by their contents, the weights by their headers, sizes and samples "
            "(not read whole)"]), spelled
    # saved with a relative path, resumed from another working directory through another one: not moved
    monkeypatch.chdir(tmp_path / "models")
    _saved(tmp_path / "rel", "base")
    monkeypatch.chdir(elsewhere)
    said = []
    resumed, counter = _manager(tmp_path / "rel" / "ckpt", os.path.join("..", "models", "base"), said)
    assert resumed.maybe_resume("auto") == resumed.step_dir(3) and not [s for s in said if " moved from " in s], said
    # another directory with other files is another setting, as before
    other = _model_dir(tmp_path / "other", seed=1)
    with pytest.raises(UserError, match=r"other training settings \(.*actor_rollout_ref\.model\.path: '[^']*base' -> "
                                        f"'{other}'"):
        _manager(tmp_path / "ckpt", other)[0].maybe_resume("auto")


def _sharded_dir(path, seed=0):
    """A model directory with its weights in two shards and an index, and a tokenizer file."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "qwen2", "hidden_size": 64}, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    g = torch.Generator().manual_seed(seed)
    names = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
             "lm_head.weight": "model-00002-of-00002.safetensors"}
    for name, file in names.items():
        save_file({name: torch.randn(512, 64, generator=g)}, os.path.join(path, file))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": names}, f)
    return str(path)


def test_files_the_loaders_do_not_read_never_refuse_a_resume(tmp_path):
    """Every *.json and *.txt of a model directory was fingerprinted: a Hugging Face Trainer's
    trainer_state.json, an eval_results.json or an evaluation's notes written into it later refused
    the resume ("eval_results.json differ"), with no way past it. Only the files a model, adapter or
    tokenizer is read from count; a changed config or shard is still refused."""
    from trainer.checkpointing import model_dir_fingerprint

    base = _sharded_dir(tmp_path / "base")
    _saved(tmp_path, base)
    for name, text in (("trainer_state.json", '{"global_step": 100}'), ("all_results.json", '{"eval_loss": 1.0}'),
                       ("eval_results.json", '{"eval_loss": 1.0}'), ("eval_notes.txt", "gsm8k 41.2")):
        with open(os.path.join(base, name), "w") as f:
            f.write(text)
    resumed, counter = _manager(tmp_path / "ckpt", base)
    assert resumed.maybe_resume("auto") == resumed.step_dir(3) and counter.step == 3
    assert sorted(model_dir_fingerprint(base)) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer_config.json"]
    # a shard that changed is refused, named
    g = torch.Generator().manual_seed(1)
    save_file({"lm_head.weight": torch.randn(512, 64, generator=g)},
              os.path.join(base, "model-00002-of-00002.safetensors"))
    with pytest.raises(UserError, match=r"other files than actor_rollout_ref\.model\.path=.* \(model-00002-of-00002"
                                        r"\.safetensors differ"):
        _manager(tmp_path / "ckpt", base)[0].maybe_resume("auto")


def test_a_checkpoint_that_fingerprinted_other_files_compares_the_files_read(tmp_path):
    """A checkpoint of an older meshppo recorded every *.json and *.txt: such a file, since changed
    or gone, is not compared (it is no part of the model); the files read still are."""
    base = _model_dir(tmp_path / "base")
    with open(os.path.join(base, "eval_results.json"), "w") as f:
        f.write('{"eval_loss": 1.0}')
    step = _saved(tmp_path, base)
    state_file = os.path.join(step, STATE_FILE)
    with open(state_file) as f:
        state = json.load(f)
    for recorded in state["bases"].values():
        recorded["fingerprint"]["eval_results.json"] = "0" * 32  # as an older meshppo recorded it
    with open(state_file, "w") as f:
        json.dump(state, f)
    os.remove(os.path.join(base, "eval_results.json"))
    resumed, counter = _manager(tmp_path / "ckpt", base)
    assert resumed.maybe_resume("auto") == resumed.step_dir(3) and counter.step == 3
    _model_dir(base, seed=1)
    with pytest.raises(UserError, match=r"\(model\.safetensors differ"):
        _manager(tmp_path / "ckpt", base)[0].maybe_resume("auto")


def test_a_checkpoint_without_fingerprints_compares_resolved_paths_and_says_so(tmp_path):
    base = _model_dir(tmp_path / "base")
    step = _saved(tmp_path, base)
    state_file = os.path.join(step, STATE_FILE)
    with open(state_file) as f:
        state = json.load(f)
    del state["bases"]  # as an older meshppo wrote it
    with open(state_file, "w") as f:
        json.dump(state, f)
    os.symlink(base, tmp_path / "link")
    said = []
    resumed, counter = _manager(tmp_path / "ckpt", str(tmp_path / "link"), said)
    assert resumed.maybe_resume("auto") and counter.step == 3
    assert any("their files are not compared" in s for s in said)
    with pytest.raises(UserError, match=r"other training settings \(.*actor_rollout_ref\.model\.path: "):
        _manager(tmp_path / "ckpt", _model_dir(tmp_path / "other"))[0].maybe_resume("auto")


def test_the_fingerprint_reads_headers_and_samples_not_whole_weights(tmp_path):
    from trainer.checkpointing import model_dir_fingerprint

    base = _model_dir(tmp_path / "base")
    with open(os.path.join(base, "README.md"), "w") as f:
        f.write("notes")
    os.makedirs(os.path.join(base, "additional_chat_templates", "notes"))
    for name in ("chat_template.jinja", "additional_chat_templates/tool_use.jinja", "additional_chat_templates/x.md"):
        with open(os.path.join(base, name), "w") as f:
            f.write("{{ messages }}")
    first = model_dir_fingerprint(base)
    # a README is no part of the model; the chat templates transformers reads are
    assert sorted(first) == ["additional_chat_templates/tool_use.jinja", "chat_template.jinja", "config.json",
                             "model.safetensors"]
    with open(os.path.join(base, "README.md"), "w") as f:
        f.write("other notes")
    assert model_dir_fingerprint(base) == first
    assert model_dir_fingerprint(str(tmp_path / "missing")) is None and model_dir_fingerprint("Qwen/Qwen3-0.6B") is None
