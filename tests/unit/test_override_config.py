"""verl's `model.override_config` for the actor, the critic and the reward model: the keys that act
set the model's arguments (`models.args.apply_overrides`) and reach the exported config.json; keys
of the architecture or the tensors' shapes, a dropout other than 0 and any other key are refused
naming `<section>.override_config.<key>`; verl 0.9.1's nested form (`model_config: {...}`) gives its keys; the accepted keys that change
nothing are said at start-up; a resume compares the overrides that act. (That every model and the
engine are built with theirs: tests/multiproc/test_override_config.py.)"""

import dataclasses
import json
import math
import os
import warnings

import pytest
import torch

from models import ModelArgs, Transformer, load_model_args
from models.args import apply_overrides
from models.checkpoint import CheckpointFileError, checkpoint_tensors
from models.transformer import rope_inv_freq
from trainer.checkpointing import run_differences, same_run_keys
from trainer.config import PPOConfig, config_notes, model_sections
from trainer.configlib import ConfigError, build_dataclass, load_config
from tests.unit.test_rope_yarn import hf_rope_checkpoint

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                    "demo.yaml")
SECTIONS = ("actor_rollout_ref.model", "critic.model", "reward_model.model")
ARGS = ModelArgs(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=2048, eos_token_id=2)


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _overrides(cfg, section):
    return model_sections(cfg)[section].override_config


@pytest.fixture
def model_dir(tmp_path):
    Transformer.build(ARGS, seed=0).save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_verls_example_max_position_embeddings_loads(model_dir):
    """examples/gmpo_trainer/test_dapo_7b_math.sh: `+actor_rollout_ref.model.override_config.max_position_embeddings=32768`."""
    cfg = _cfg("+actor_rollout_ref.model.override_config.max_position_embeddings=32768")
    overrides = cfg.actor_rollout_ref.model.override_config
    assert overrides == {"max_position_embeddings": 32768} and config_notes(cfg) == []
    assert dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(cfg))) == dataclasses.asdict(cfg)
    args = load_model_args(model_dir, overrides)
    assert args == dataclasses.replace(load_model_args(model_dir), max_position_embeddings=32768)


# what makes the demo's run build each section's model (the demo trains no critic and has no reward model)
WITH_MODEL = {"actor_rollout_ref.model": (), "critic.model": ("algorithm.adv_estimator=gae",),
              "reward_model.model": ("reward_model.enable=true", "reward_model.model.path=/rm")}


@pytest.mark.parametrize("section", SECTIONS)
def test_each_sections_overrides_are_checked(section):
    cfg = _cfg(f"{section}.override_config={{rope_theta: 5.0e5, rms_norm_eps: 1e-5, use_cache: false}}",
               *WITH_MODEL[section])
    args = apply_overrides(ARGS, _overrides(cfg, section))  # YAML 1.1 reads 5.0e5 and 1e-5 as text: numbers here
    assert args == dataclasses.replace(ARGS, rope_theta=5e5, rms_norm_eps=1e-5)
    assert [n for n in config_notes(cfg) if "override_config" in n] == [
        f"{section}.override_config.use_cache=false has no effect: meshppo's training forwards keep no KV cache (its "
        "engine has its own)"]
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias", "model_type"):
        with pytest.raises(ConfigError) as e:
            _cfg(f"{section}.override_config.{key}=1")
        assert str(e.value).startswith(f"{section}.override_config.{key} cannot be overridden: it sets the "
                                       "architecture or the shapes of the model's tensors"), str(e.value)


def test_shapes_and_architecture_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^critic.model.override_config.num_key_value_heads cannot be overridden"):
        _cfg("critic.model.override_config.num_key_value_heads=1")


K = "actor_rollout_ref.model.override_config"


@pytest.mark.parametrize("override, message", [
    ("attention_dropout=0.1", f"{K}.attention_dropout=0.1 is not supported by meshppo: meshppo's models have no "
                              "dropout (0 is accepted)"),
    ("hidden_dropout=0.2", f"{K}.hidden_dropout=0.2 is not supported by meshppo"),
    ("attention_dropout=-1", f"{K}.attention_dropout: expected a number >= 0, got -1"),
    ("output_hidden_states=true", f"{K}.output_hidden_states is not supported by meshppo: the keys it applies are "
                                  "max_position_embeddings, rope_theta, rope_scaling, rms_norm_eps"),
    ("model_config=[1]", f"{K}.model_config: expected a mapping of the model config's attributes, got [1]"),
    ("model_config={rope_theta: 0}", f"{K}.model_config.rope_theta: expected a number > 0, got 0"),
    ("model_config={hidden_size: 8}", f"{K}.model_config.hidden_size cannot be overridden"),
    ("rope_scaling={type: dynamic, factor: 2.0}", f"{K}.rope_scaling: type 'dynamic' is not supported (its "
                                                  "frequencies change with each forward's sequence length, so a "
                                                  "token's log-prob would depend on its batch); meshppo's models "
                                                  "implement ('default', 'linear', 'llama3', 'yarn')"),
    ("rope_scaling={rope_type: yarn, factor: 4.0, truncate: 0}", f"{K}.rope_scaling.truncate: expected true or "
                                                                 "false, got 0"),
    ("rope_scaling={rope_type: yarn, factor: 4.0, beta_fast: 1, beta_slow: 2}",
     f"{K}.rope_scaling: beta_fast must not be below beta_slow (their defaults: 32 and 1)"),
    ("rope_scaling={rope_type: yarn, factor: 4.0, mscale: -1}", f"{K}.rope_scaling.mscale: expected a number >= 0"),
    ("rope_scaling={rope_type: yarn, factor: 4.0, low_freq_factor: 1.0}", "['low_freq_factor'] would be ignored"),
    ("rope_scaling={factor: 2.0}", f"{K}.rope_scaling: give its type once, as rope_type (or type)"),
    ("rope_scaling={type: linear, rope_type: llama3, factor: 2.0}", f"{K}.rope_scaling: give its type once"),
    ("rope_scaling={type: linear}", f"{K}.rope_scaling: type 'linear' reads ['factor'] (['factor'] required); "
                                    "missing ['factor']"),
    ("rope_scaling={type: linear, factor: 2.0, low_freq_factor: 1.0}", "['low_freq_factor'] would be ignored"),
    ("rope_scaling={rope_type: llama3, factor: 8.0, original_max_position_embeddings: 8192, low_freq_factor: 4.0}",
     f"{K}.rope_scaling: low_freq_factor must be below high_freq_factor"),
    ("rope_scaling={type: linear, factor: 0}", f"{K}.rope_scaling.factor: expected a number > 0, got 0"),
    ("rope_theta=0", f"{K}.rope_theta: expected a number > 0, got 0"),
    ("rms_norm_eps=abc", f"{K}.rms_norm_eps: expected a number > 0, got 'abc'"),
    ("max_position_embeddings=1.5", f"{K}.max_position_embeddings: expected an integer > 0, got 1.5"),
    ("eos_token_id=[2, -1]", f"{K}.eos_token_id[1]: expected an integer >= 0, got -1"),
    ("pad_token_id=[0]", f"{K}.pad_token_id: expected an integer >= 0, got [0]"),
])
def test_what_cannot_act_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        _cfg(f"{K}.{override}")
    assert str(e.value).startswith(f"{K}.{override.split('=')[0].split('.')[0]}") and message in str(e.value), \
        str(e.value)


@pytest.mark.parametrize("section", SECTIONS)
def test_verls_nested_form_gives_its_keys(section, model_dir):
    """verl 0.9.1's model config (HFModelConfig, its FSDP engine's too) sets the attributes under
    override_config.model_config when there is one, reading attn_implementation beside it: the same
    overrides as the flat form, which the resolved config holds."""
    flat = _cfg(f"{section}.override_config={{attn_implementation: eager, max_position_embeddings: 4096, "
                "rope_theta: 500000.0}")
    nested = _cfg(f"{section}.override_config={{attn_implementation: eager, model_config: "
                  "{max_position_embeddings: 4096, rope_theta: 500000.0}}")
    assert _overrides(nested, section) == _overrides(flat, section) == {
        "attn_implementation": "eager", "max_position_embeddings": 4096, "rope_theta": 500000.0}
    assert config_notes(nested) == config_notes(flat)
    assert load_model_args(model_dir, _overrides(nested, section)) == dataclasses.replace(
        load_model_args(model_dir), max_position_embeddings=4096, rope_theta=500000.0)
    assert dataclasses.asdict(build_dataclass(PPOConfig, dataclasses.asdict(nested))) == dataclasses.asdict(nested)


def test_a_key_beside_the_nested_form_is_refused_naming_it():
    """With model_config, verl 0.9.1 leaves the other top-level keys (but attn_implementation) unread."""
    with pytest.raises(ConfigError) as e:
        _cfg(f"{K}={{rope_theta: 500000.0, model_config: {{max_position_embeddings: 4096}}}}")
    assert str(e.value) == (f"{K}.rope_theta beside {K}.model_config: verl reads only {K}.model_config's keys then "
                            f"(and attn_implementation beside it), so ['rope_theta'] would be ignored; move them into "
                            f"{K}.model_config")


def test_what_changes_nothing_is_said_at_start_up():
    rm = WITH_MODEL["reward_model.model"]
    cfg = _cfg("actor_rollout_ref.model.override_config={attn_implementation: eager, attention_dropout: 0.}",
               "reward_model.model.override_config.classifier_dropout=0", *rm)
    assert [n for n in config_notes(cfg) if "override_config" in n] == [
        "actor_rollout_ref.model.override_config.attn_implementation=eager has no effect: meshppo's attention is its "
        "own (variable-length FlashAttention or SDPA kernels), not a Hugging Face implementation",
        "actor_rollout_ref.model.override_config.attention_dropout=0.0 has no effect: meshppo's models have no dropout",
        "reward_model.model.override_config.classifier_dropout=0 has no effect: meshppo's models have no dropout"]
    # the reward model is neither exported nor drawn at random: only what its scores read acts
    cfg = _cfg("reward_model.model.override_config={rope_theta: 500, rms_norm_eps: 1.0e-5, eos_token_id: 3, "
               "max_position_embeddings: 4096}", *rm)
    why = "has no effect: the reward model's scores do not read it, and it is neither exported nor drawn at random"
    assert [n for n in config_notes(cfg) if "override_config" in n] == [f"reward_model.model.override_config.eos_token_id=3 {why}",
                                 f"reward_model.model.override_config.max_position_embeddings=4096 {why}"]


def test_verls_documented_rope_scaling_override_sets_the_inverse_frequencies(model_dir):
    """verl's docs/advance/rope.rst writes rope_scaling key by key; meshppo replaces the checkpoint's
    rope_scaling with it."""
    cfg = _cfg("+actor_rollout_ref.model.override_config.rope_scaling.type=linear",
               "+actor_rollout_ref.model.override_config.rope_scaling.factor=4.0")
    args = load_model_args(model_dir, cfg.actor_rollout_ref.model.override_config)
    assert args.rope_scaling == {"rope_type": "linear", "factor": 4.0} and args.rope_type == "linear"
    d = ARGS.head_dim
    expected = torch.tensor([10000.0 ** (-i / d) / 4 for i in range(0, d, 2)], dtype=torch.float64)
    assert torch.allclose(rope_inv_freq(args).inv_freq.double(), expected, rtol=1e-5, atol=0)
    # the default type: no scaling (the checkpoint's, if any, is replaced)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}
    scaled = dataclasses.replace(ARGS, rope_scaling=llama3)
    assert apply_overrides(scaled, {"rope_scaling": {"rope_type": "default"}}).rope_scaling is None
    assert apply_overrides(scaled, {"rope_scaling": None}).rope_scaling is None
    assert apply_overrides(scaled, {"rope_theta": 500}).rope_scaling == llama3  # rope_theta alone keeps it


def test_verls_documented_yarn_override_is_read():
    """Qwen2.5's long-context YaRN setting, key by key as verl's docs/advance/rope.rst writes
    rope_scaling, with truncate and mscale as YAML writes them (a boolean, an integer)."""
    cfg = _cfg("+actor_rollout_ref.model.override_config.rope_scaling.type=yarn",
               "+actor_rollout_ref.model.override_config.rope_scaling.factor=4.0",
               "+actor_rollout_ref.model.override_config.rope_scaling.original_max_position_embeddings=32768",
               "+actor_rollout_ref.model.override_config.rope_scaling.truncate=false",
               "+actor_rollout_ref.model.override_config.rope_scaling.mscale=0")
    args = apply_overrides(ARGS, cfg.actor_rollout_ref.model.override_config)
    assert args.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                 "truncate": False, "mscale": 0.0}
    assert rope_inv_freq(args).attention_factor == pytest.approx(1 + 0.1 * math.log(4.0), rel=1e-12)


def _load(path, overrides) -> Transformer:
    """The checkpoint's model built with `overrides` (as the trainer builds its models)."""
    with torch.device("meta"):
        model = Transformer(load_model_args(path, overrides))
    model.to_empty(device="cpu")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in checkpoint_tensors(model, path):
            params[name].copy_(tensor)
    model.reset_buffers()
    return model.eval()


def test_a_rope_scaling_override_replaces_a_type_meshppo_refuses(tmp_path):
    """verl sets override_config on the checkpoint's Hugging Face config before it is read: a dynamic
    rope checkpoint with `rope_scaling: null` is a plain-RoPE model, the logits transformers gives it
    with the scaling removed (past max_position_embeddings, where dynamic scaling would change them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = hf_rope_checkpoint(tmp_path, "llama", {"type": "dynamic", "factor": 2.0}, 10000.0,
                              max_position_embeddings=16)
    with pytest.raises(CheckpointFileError) as e:
        load_model_args(path)
    assert f"{str(path / 'config.json')!r}" in str(e.value) and "config.json's rope_scaling type 'dynamic' is not " \
        "supported" in str(e.value) and "replace it with actor_rollout_ref.model.override_config.rope_scaling" in \
        str(e.value), str(e.value)
    ours = _load(path, {"rope_scaling": None})
    assert ours.args.rope_scaling is None and ours.args.rope_theta == 10000.0
    plain = AutoConfig.from_pretrained(path)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    reference = AutoModelForCausalLM.from_pretrained(path, config=plain, attn_implementation="eager").eval()
    dynamic = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, expected = ours(ids), reference(input_ids=ids).logits
        assert (dynamic(input_ids=ids).logits - expected).abs().max() > 0.1  # the scaling dropped is no no-op
    assert (got - expected).abs().max() <= 1e-4
    # any supported type replaces it as well
    assert _load(path, {"rope_scaling": {"type": "linear", "factor": 2.0}}).args.rope_scaling == \
        {"rope_type": "linear", "factor": 2.0}


def test_token_ids_and_numbers_as_yaml_writes_them():
    args = apply_overrides(ARGS, {"eos_token_id": [2, 5], "bos_token_id": 1, "pad_token_id": None,
                                  "rms_norm_eps": "1e-5", "rope_theta": 500, "max_position_embeddings": 4096.0,
                                  "initializer_range": 0.1})
    assert (args.eos_token_id, args.bos_token_id, args.pad_token_id) == ([2, 5], 1, None)
    assert (args.rms_norm_eps, args.rope_theta, args.max_position_embeddings, args.initializer_range) == \
        (1e-5, 500.0, 4096, 0.1)
    assert type(args.max_position_embeddings) is int and type(args.rope_theta) is float
    assert apply_overrides(ARGS, {}) is ARGS and apply_overrides(ARGS, None) is ARGS


def test_the_exported_config_carries_the_overridden_values(model_dir, tmp_path):
    """As verl saves its overridden Hugging Face config: the export of a model built with the
    overrides (`save_pretrained` writes `model.args`) reads back with them, in meshppo and in
    transformers."""
    from transformers import AutoConfig

    overrides = {"rope_theta": 500.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "eos_token_id": [2, 7],
                 "rope_scaling": {"type": "linear", "factor": 2.0}, "attn_implementation": "sdpa"}
    args = load_model_args(model_dir, overrides)
    with torch.device("meta"):
        shell = Transformer(args)
    out = tmp_path / "export"
    state_dict = Transformer.from_pretrained(model_dir).state_dict()
    with warnings.catch_warnings():  # the export sets no attribute transformers deprecates (v5: rope_scaling)
        warnings.simplefilter("error", FutureWarning)
        shell.save_pretrained(out, state_dict=state_dict)
    assert load_model_args(out) == args
    hf = AutoConfig.from_pretrained(out)
    assert (hf.max_position_embeddings, hf.rms_norm_eps, hf.eos_token_id) == (4096, 1e-5, [2, 7])
    assert hf.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}
    on_disk = json.loads((out / "config.json").read_text())
    assert on_disk["rope_theta"] == 500.0 and "attn_implementation" not in on_disk


def test_a_resume_compares_the_overrides_that_act():
    keys = {k for k, _ in same_run_keys()}
    assert {f"{s}.override_config" for s in SECTIONS} <= keys
    saved = dataclasses.asdict(_cfg())
    for section in SECTIONS:
        inert = _cfg(f"{section}.override_config={{attn_implementation: eager, attention_dropout: 0}}")
        assert run_differences(saved, dataclasses.asdict(inert)) == []
        acting = _cfg(f"{section}.override_config={{rope_theta: 500, use_cache: false}}")
        assert run_differences(saved, dataclasses.asdict(acting)) == [
            (f"{section}.override_config", {}, {"rope_theta": 500, "use_cache": False})]
    # the reward model's exported-only keys change nothing (it is never exported); the critic's reach its export
    for section, differs in (("reward_model.model", False), ("critic.model", True)):
        current = dataclasses.asdict(_cfg(f"{section}.override_config.max_position_embeddings=4096"))
        assert bool(run_differences(saved, current)) == differs


def test_model_args_refuse_a_rope_scaling_without_its_parameters():
    with pytest.raises(ValueError, match=r"rope_scaling of type 'llama3' lacks \['original_max_position_embeddings'\]"):
        dataclasses.replace(ARGS, rope_scaling={"rope_type": "llama3", "factor": 8.0})
