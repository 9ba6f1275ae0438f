"""Damaged or mismatched model, tokenizer and adapter files: each read raises one error, in one line,
that names the file (and the config key it came from), before any model is built."""

import json
import os
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models.checkpoint import CheckpointFileError, checkpoint_tensor_names, load_model_args, safetensors_files  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


def _qwen2(path, vocab_size=40, layers=1, classifier=False):
    cfg = transformers.Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   num_labels=1, pad_token_id=0, tie_word_embeddings=True)
    torch.manual_seed(0)
    cls = transformers.Qwen2ForSequenceClassification if classifier else transformers.Qwen2ForCausalLM
    cls(cfg).save_pretrained(path)
    return path


def _edit_json(file, **change):
    data = json.loads(file.read_text())
    data.update(change)
    file.write_text(json.dumps(data))


# ---------------------------------------------------------------------- checkpoints (config.json, index, weights)
@pytest.mark.parametrize("change,named", [
    ({"hidden_size": "96"}, "hidden_size"),
    ({"num_hidden_layers": 2}, "num_hidden_layers"),  # layer_types lists 1
    ({"num_attention_heads": 0}, "num_attention_heads=0 is not a positive integer"),
])
def test_an_edited_config_json_is_named(tmp_path, change, named):
    """transformers' strict config validation and meshppo's own arithmetic once escaped as raw
    StrictDataclass*Error / ZeroDivisionError tracebacks (in the CLI's start-up notes too)."""
    from trainer.setup import _readable_model_args

    model = _qwen2(tmp_path / "m")
    _edit_json(model / "config.json", **change)
    with pytest.raises(CheckpointFileError) as e:
        load_model_args(model)
    assert f"{str(model / 'config.json')!r}" in _one_line(e) and named in str(e.value)
    assert _readable_model_args(str(model)) is None  # the start-up notes leave it to the load's one line


@pytest.mark.parametrize("index,named", [('{"metadata": {}}', 'has no "weight_map"'),
                                         ('{"weight_map": ', "JSONDecodeError"),
                                         ('{"weight_map": ["model.safetensors"]}', 'has no "weight_map"')])
def test_a_malformed_safetensors_index_is_named(tmp_path, index, named):
    model = _qwen2(tmp_path / "m")
    (model / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointFileError) as e:
        safetensors_files(model)
    assert f"{str(model / 'model.safetensors.index.json')!r}" in _one_line(e) and named in str(e.value)


def test_a_truncated_reward_model_is_named(tmp_path):
    """The reward model's first read (its tensor names, for the score head) once raised safetensors'
    own SafetensorError."""
    from data.demo import build_demo_tokenizer
    from trainer.config import RewardModelConfig, RewardModelModelConfig
    from trainer.setup import reward_model_inputs

    rm = _qwen2(tmp_path / "rm", classifier=True)
    weights = rm / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointFileError) as e:
        checkpoint_tensor_names(rm)
    assert _one_line(e).startswith(f"{str(weights)!r} is not a readable safetensors file (SafetensorError: ")
    cfg = RewardModelConfig(enable=True, model=RewardModelModelConfig(path=str(rm), input_tokenizer=None))
    with pytest.raises(CheckpointFileError, match="is not a readable safetensors file"):
        reward_model_inputs(cfg, build_demo_tokenizer(), "/models/actor")


# ---------------------------------------------------------------------- tokenizers
def _damaged_tokenizer(tmp_path, damage):
    from data.demo import build_demo_tokenizer

    d = tmp_path / "tok"
    build_demo_tokenizer(d)
    if damage == "truncated tokenizer.json":
        text = (d / "tokenizer.json").read_text()
        (d / "tokenizer.json").write_text(text[:len(text) // 2])
        return d, d / "tokenizer.json"
    if damage == "tokenizer_config.json not JSON":
        (d / "tokenizer_config.json").write_text("{bad")
        return d, d / "tokenizer_config.json"
    assert damage == "only tokenizer_config.json"
    for f in d.iterdir():
        if f.name != "tokenizer_config.json":
            f.unlink()
    return d, d


DAMAGES = ["truncated tokenizer.json", "tokenizer_config.json not JSON", "only tokenizer_config.json"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_tokenizer_is_named_with_its_key(tmp_path, damage):
    """JSONDecodeError (without the file's name) or transformers' "Couldn't instantiate the backend
    tokenizer" once came as tracebacks: for the actor's tokenizer and the reward model's."""
    from models.tokenizer import load_tokenizer
    from trainer.config import RewardModelConfig, RewardModelModelConfig
    from trainer.setup import reward_model_inputs

    d, named = _damaged_tokenizer(tmp_path, damage)
    with pytest.raises(CheckpointFileError) as e:
        load_tokenizer(str(d), "data.tokenizer")
    assert _one_line(e).startswith(f"{str(named)!r} (data.tokenizer) ")
    if named == d:
        return  # (next to a model's config.json, transformers builds that model's tokenizer class from it)
    rm = _qwen2(tmp_path / "rm", vocab_size=40, classifier=True)
    for f in d.iterdir():
        shutil.copy(f, rm / f.name)
    good = tmp_path / "good"
    from data.demo import build_demo_tokenizer
    actor = build_demo_tokenizer(good)
    cfg = RewardModelConfig(enable=True, model=RewardModelModelConfig(path=str(rm), input_tokenizer=str(good)))
    with pytest.raises(CheckpointFileError) as e:
        reward_model_inputs(cfg, actor, "/models/actor")
    assert _one_line(e).startswith(f"{str(rm / named.name)!r} (reward_model.model.path) is not a readable JSON file")


@pytest.mark.parametrize("error,package", [
    (ModuleNotFoundError("No module named 'sentencepiece'", name="sentencepiece"), "the sentencepiece package"),
    (ImportError("LlamaConverter requires the protobuf library but it was not found in your environment."),
     "requires the protobuf library"),
])
def test_a_tokenizer_needing_a_missing_package_is_not_called_damaged(tmp_path, monkeypatch, error, package):
    """An ImportError while loading the tokenizer (sentencepiece, tiktoken or protobuf not installed) was
    reported as "holds tokenizer files that do not load", sending the user to files that are sound."""
    from data.demo import build_demo_tokenizer
    from models.tokenizer import load_tokenizer

    d = tmp_path / "tok"
    build_demo_tokenizer(d)

    def missing(*a, **k):
        raise error

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", missing)
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", missing)
    with pytest.raises(ImportError) as e:
        load_tokenizer(str(d), "data.tokenizer")
    assert not isinstance(e.value, CheckpointFileError) and e.value.__cause__ is error
    assert str(e.value).startswith(f"loading the tokenizer in {str(d)!r} (data.tokenizer) needs ")
    assert package in str(e.value) and "do not load" not in str(e.value)


# ---------------------------------------------------------------------- the actor's tokenizer against its model
def _cfg(*overrides):
    from trainer.config import PPOConfig
    from trainer.configlib import load_config

    return load_config(PPOConfig, os.path.join(ROOT, "configs", "demo.yaml"), list(overrides))


def _big_tokenizer(tmp_path, extra):
    from data.demo import build_demo_tokenizer

    tok = build_demo_tokenizer()
    tok.add_tokens([f"<x{i}>" for i in range(extra)])
    tok.save_pretrained(tmp_path / "big_tok")
    return tmp_path / "big_tok", len(tok)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_at_setup(tmp_path):
    """An id past the actor's vocab_size once stopped the first generation (a traceback from the
    engine, after resume_mode=disable had deleted the earlier checkpoints). One-sided: a model
    embedding more ids than the tokenizer has (Qwen's padded 151936 for 151665) is as it should be."""
    from trainer.errors import UserError
    from trainer.setup import load_actor_tokenizer

    tok, size = _big_tokenizer(tmp_path, 20)
    padded = _qwen2(tmp_path / "padded", vocab_size=size + 7)
    assert len(load_actor_tokenizer(_cfg(f"actor_rollout_ref.model.path={padded}", f"data.tokenizer={tok}"))) == size
    small = _qwen2(tmp_path / "small", vocab_size=size - 3)
    with pytest.raises(UserError) as e:
        load_actor_tokenizer(_cfg(f"actor_rollout_ref.model.path={small}", f"data.tokenizer={tok}"))
    assert _one_line(e).startswith(f"the tokenizer (data.tokenizer {str(tok)!r}) has {size} token ids but the model "
                                   f"of actor_rollout_ref.model.path {str(small)!r} embeds {size - 3} (vocab_size)")
    # a critic of its own model directory scores the actor's tokens: it must embed them too
    with pytest.raises(UserError, match=rf"model of critic.model.path '{small}' embeds {size - 3}"):
        load_actor_tokenizer(_cfg(f"actor_rollout_ref.model.path={padded}", f"data.tokenizer={tok}",
                                  "algorithm.adv_estimator=gae", f"critic.model.path={small}"))


def test_a_pad_token_past_the_models_vocabulary_is_refused_saying_why(tmp_path):
    """Llama-2 with a [PAD] added and its embeddings not resized: the pad id is one past vocab_size. It
    is refused, not let through as a token no prompt holds: meshppo pads the models' inputs with it
    (the padded layout, Ulysses padding, the HF rollout, the reward model's batches), and the
    refusal says so, with what to do."""
    from data.demo import build_demo_tokenizer
    from trainer.errors import UserError
    from trainer.setup import load_actor_tokenizer, reward_model_inputs

    tok = build_demo_tokenizer()
    n = len(tok)
    tok.add_special_tokens({"pad_token": "[PAD]"})
    assert tok.pad_token_id == n
    tok.save_pretrained(tmp_path / "tok")
    model = _qwen2(tmp_path / "m", vocab_size=n)
    with pytest.raises(UserError) as e:
        load_actor_tokenizer(_cfg(f"actor_rollout_ref.model.path={model}", f"data.tokenizer={tmp_path / 'tok'}"))
    assert f"its pad token '[PAD]' (id {n}) is one of them, and meshppo pads the models' inputs" in _one_line(e)
    rm = _qwen2(tmp_path / "rm", vocab_size=n, classifier=True)
    from trainer.config import RewardModelConfig, RewardModelModelConfig
    cfg = RewardModelConfig(enable=True, model=RewardModelModelConfig(path=str(rm), input_tokenizer=None))
    with pytest.raises(UserError, match=rf"its pad token '\[PAD\]' \(id {n}\) is one of them"):
        reward_model_inputs(cfg, tok, "/models/actor")


# ---------------------------------------------------------------------- LoRA adapters
def _adapter(tmp_path, shapes=None, corrupt=False):
    """A peft adapter (r 4, q_proj) for `_qwen2`'s one-layer model: its weights `shapes` (A, B), or garbage."""
    from safetensors.torch import save_file

    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4,
                                                       "lora_alpha": 8, "target_modules": ["q_proj"]}))
    weights = d / "adapter_model.safetensors"
    if corrupt:
        weights.write_bytes(b"not a header")
    else:
        a, b = shapes or ((4, 32), (32, 4))
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        save_file({f"{prefix}.lora_A.weight": torch.zeros(a), f"{prefix}.lora_B.weight": torch.zeros(b)}, str(weights))
    return d, weights


def test_a_corrupt_lora_adapter_is_named(tmp_path):
    """safetensors' SafetensorError from the adapter's weights once escaped the config's check as a traceback."""
    from models.lora import read_peft_adapter
    from trainer.config import validate
    from trainer.configlib import ConfigError

    d, weights = _adapter(tmp_path, corrupt=True)
    with pytest.raises(CheckpointFileError) as e:
        read_peft_adapter(d)
    assert _one_line(e).startswith(f"{str(weights)!r} is not a readable safetensors file (SafetensorError: ")
    model = _qwen2(tmp_path / "m")
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref.model.lora_adapter_path: '{weights}' is not a readable"):
        validate(_cfg(f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.lora_adapter_path={d}"))


def test_a_lora_adapter_of_other_shapes_is_refused_before_any_model_is_built(tmp_path):
    """An adapter for a wider model once passed the config's checks and failed as a traceback while the
    actor was sharded, after the data had loaded: preflight checks its shapes against the model's."""
    from models.lora import read_peft_adapter, read_peft_adapter_shapes
    from trainer.configlib import ConfigError
    from trainer.setup import check_lora_adapter

    model = _qwen2(tmp_path / "m")
    d, weights = _adapter(tmp_path, shapes=((4, 64), (32, 4)))
    read_peft_adapter(d)  # the files themselves are fine
    with pytest.raises(ValueError, match=rf"'{weights}': layers.0.self_attn.q_proj.lora_A has shape \(4, 64\), "
                                         r"the model needs \(4, 32\)"):
        read_peft_adapter_shapes(d, load_model_args(model))
    cfg = _cfg(f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.lora_adapter_path={d}")
    with pytest.raises(ConfigError) as e:
        check_lora_adapter(cfg)
    assert _one_line(e).startswith(f"actor_rollout_ref.model.lora_adapter_path: adapter {str(weights)!r}: ")
    shutil.rmtree(d)
    _adapter(tmp_path)
    check_lora_adapter(cfg)  # the model's shapes pass


def test_the_lora_adapter_checks_before_the_run_read_no_tensor(tmp_path, monkeypatch):
    """validate and preflight's shape check once each loaded every tensor of the adapter (gigabytes for a
    70B model's) on every rank and in the launcher: they read its safetensors header alone, the tensors
    being read once, where the actor is built."""
    import safetensors
    import safetensors.torch

    from models.lora import read_peft_adapter
    from trainer.config import validate
    from trainer.configlib import ConfigError
    from trainer.setup import check_lora_adapter

    model = _qwen2(tmp_path / "m")
    d, weights = _adapter(tmp_path)
    real_open = safetensors.safe_open

    class NoTensors:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, key):
            raise AssertionError("a tensor was read")

        def get_slice(self, key):  # its shape only: indexing a slice would read its data
            shape = self.f.get_slice(key).get_shape()
            return type("ShapeOnly", (), {"get_shape": lambda _: shape})()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def no_load(*a, **k):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(safetensors, "safe_open", NoTensors)
    monkeypatch.setattr(safetensors.torch, "load_file", no_load)
    monkeypatch.setattr(safetensors.torch, "load", no_load)
    monkeypatch.setattr(torch, "load", no_load)
    cfg = _cfg(f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.model.lora_adapter_path={d}")
    validate(cfg)
    check_lora_adapter(cfg)
    shutil.rmtree(d)
    _adapter(tmp_path, shapes=((4, 64), (32, 4)))
    with pytest.raises(ConfigError, match="lora_A has shape"):
        check_lora_adapter(cfg)
    with pytest.raises(AssertionError, match="a tensor was read"):  # the guard holds where tensors are read
        read_peft_adapter(d)
