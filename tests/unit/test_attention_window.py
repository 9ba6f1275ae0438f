"""Sliding-window attention (Mistral's `sliding_window`, Qwen2's `use_sliding_window` layers): meshppo's attention
reads the whole context, which gives transformers' windowed logits exactly for sequences no longer than the window.
A run is accepted where every sequence it makes fits in the window of every model it builds, and refused before
any work, naming the keys, where one can reach past it; `override_config.sliding_window` sets the window (null:
none), as verl sets it on the Hugging Face config. References: transformers' windowed models in float64."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from models.args import apply_overrides
from tests.unit.hf_family import TOL, hf_causal_lm, one_thread

transformers = pytest.importorskip("transformers")

VOCAB = 97
WINDOW = 64


_one_thread = one_thread


def _mistral(tmp_path, window=WINDOW):
    """A saved MistralForCausalLM whose every layer attends through `window` (Mistral-7B-v0.1's 4096 of 32768)."""
    hf = hf_causal_lm(transformers.MistralConfig, transformers.MistralForCausalLM, vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, sliding_window=window,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.save_pretrained(tmp_path / "mistral")
    return hf, tmp_path / "mistral"


def _qwen2(tmp_path, window=32, max_window_layers=1):
    """A saved Qwen2ForCausalLM whose layers from `max_window_layers` on attend through `window`."""
    hf = hf_causal_lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, use_sliding_window=True, sliding_window=window,
                      max_window_layers=max_window_layers, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path / "qwen2")
    return hf, tmp_path / "qwen2"


def _max_diff(ours, hf, n, seed=1):
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(ids) - hf(input_ids=ids).logits).abs().max().item()


def test_mistral_window_logits_are_transformers_within_the_window(tmp_path):
    """A Mistral with sliding_window 64 below max_position_embeddings 256 loads (it was refused at load):
    its logits equal transformers' windowed model for sequences of up to 64 tokens, and they differ at 65,
    where the window first hides a position: the bound the run is checked against is tight."""
    hf, path = _mistral(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.attention_window == WINDOW and ours.args.windowed_layers == [0, 1]
    assert ours.args.window_exceeded(WINDOW) is None
    assert _max_diff(ours, hf, 48) <= TOL and _max_diff(ours, hf, WINDOW) <= TOL
    assert _max_diff(ours, hf, WINDOW + 1) > 1e-3


def test_qwen2_windowed_layers_logits_are_transformers_within_the_window(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers 1 of 3 layers (layers 1 and 2 windowed by 32): it loads
    (it was refused), and its logits are transformers' (sdpa, float64) up to 32 tokens; at 33 they differ."""
    hf, path = _qwen2(tmp_path)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.windowed_layers == [1, 2] and ours.args.attention_window == 32
    assert _max_diff(ours, hf, 20) <= TOL and _max_diff(ours, hf, 32) <= TOL
    assert _max_diff(ours, hf, 33) > 1e-3
    # the same keys read from a config.json before transformers v5 (no layer_types)
    cfg = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=32)
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=1)).windowed_layers == [1, 2]
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=3)).attention_window is None
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=1, use_sliding_window=False)).attention_window is None
    with pytest.raises(ValueError, match="layer_types=.*meshppo supports"):
        ModelArgs.from_hf_config(dict(cfg, layer_types=["full_attention", "chunked_attention", "full_attention"]))


def _cfg(path, prompt, response, *extra):
    from tests.unit.test_bad_model_files import _cfg

    return _cfg(f"actor_rollout_ref.model.path={path}", f"data.max_prompt_length={prompt}",
                f"data.max_response_length={response}", *extra)


def test_preflight_accepts_runs_within_the_window_and_refuses_longer_ones_naming_the_keys(tmp_path):
    """The trainer's pre-flight: prompt 16 + response 32 = 48 (and 64 exactly) within Mistral's window of 64 runs
    (verl trains Mistral-7B-v0.1 at prompt 1024 + response 2048 < 4096 so); 16 + 64 = 80 is refused naming
    config.json's key and value, the model's path, the run's keys that set the length and what to do. A larger
    rollout.max_model_len is the engine's capacity only: no sequence reaches past prompt + response."""
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _mistral(tmp_path)
    preflight(_cfg(path, 16, 32), devices=False)
    preflight(_cfg(path, 16, 48, "actor_rollout_ref.rollout.max_model_len=200"), devices=False)
    with pytest.raises(ConfigError) as e:
        preflight(_cfg(path, 16, 64), devices=False)
    message = str(e.value)
    assert message.startswith(f"actor_rollout_ref.model.path {str(path)!r} (the actor's model, also the reference's "
                              "and the rollout's): config.json's sliding_window=64 (every layer of "
                              "transformers' Mistral attends through it): "), message
    assert ("and the run's sequences reach 80 tokens (data.max_prompt_length + actor_rollout_ref.rollout."
            "response_length = 16 + 64); lower data.max_prompt_length + actor_rollout_ref.rollout.response_length "
            "to at most 64 tokens, or set actor_rollout_ref.model.override_config.sliding_window=null") in message


def test_the_qwen2_window_is_checked_at_preflight(tmp_path):
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _qwen2(tmp_path)
    preflight(_cfg(path, 16, 16), devices=False)
    with pytest.raises(ConfigError, match=r"config.json's sliding_window=32 with use_sliding_window=true, "
                                          r"max_window_layers=1 \(layers \[1, 2\] of 3 of transformers' Qwen2 "
                                          r"attend through it\).* reach 33 tokens"):
        preflight(_cfg(path, 16, 17), devices=False)


def test_override_config_sliding_window_sets_the_window(tmp_path):
    """override_config.sliding_window, set on the config before the model is built as in verl: null attends to the
    whole context (the long run is accepted), a window at least the run's longest sequence too, a shorter one is
    refused; it is kept out of the checkpoint's fingerprint (the trainer's: the fields without extra_hf) and reaches
    the critic's and the reward model's checks under their own keys. A bad value or a model without a window is
    refused naming the key."""
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _mistral(tmp_path)
    key = "actor_rollout_ref.model.override_config"
    preflight(_cfg(path, 16, 64, f"{key}.sliding_window=null"), devices=False)
    preflight(_cfg(path, 16, 64, f"{key}.sliding_window=80"), devices=False)
    with pytest.raises(ConfigError, match="sliding_window=79 .* reach 80 tokens"):
        preflight(_cfg(path, 16, 64, f"{key}.sliding_window=79"), devices=False)
    with pytest.raises(ConfigError, match=f"{key}.sliding_window: expected an integer > 0, got 0"):
        _cfg(path, 16, 64, f"{key}.sliding_window=0")

    from models.checkpoint import load_model_args

    args = load_model_args(path)
    unwindowed = load_model_args(path, {"sliding_window": None})
    assert unwindowed.attention_window is None and apply_overrides(args, {"sliding_window": None}) == unwindowed
    fingerprint = lambda a: __import__("dataclasses").asdict(a) | {"extra_hf": None}  # noqa: E731 (ppo_trainer's)
    assert fingerprint(args) == fingerprint(unwindowed)

    # the critic (adv_estimator gae) of the windowed model, under its own override
    gae = ("algorithm.adv_estimator=gae", f"critic.model.path={path}")
    with pytest.raises(ConfigError, match=r"^critic.model.path .*critic.model.override_config.sliding_window=null"):
        preflight(_cfg(path, 16, 64, f"{key}.sliding_window=null", *gae), devices=False)
    preflight(_cfg(path, 16, 64, f"{key}.sliding_window=null", *gae, "critic.model.override_config.sliding_window=null"),
              devices=False)

    llama = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(llama)
    with pytest.raises(ValueError, match="override_config.sliding_window=8: model_type llama has no sliding window"):
        load_model_args(llama, {"sliding_window": 8})


def test_reward_model_window_is_checked_against_what_it_reads(tmp_path):
    """A reward model reading the actor's tokens (input_tokenizer null) is checked against prompt + response; one
    rendering each chat anew (input_tokenizer set) against reward_model.max_length, and refused without one."""
    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError
    from trainer.setup import check_attention_windows

    _, path = _mistral(tmp_path)
    base = ("reward_model.enable=true", f"reward_model.model.path={path}")
    cfg = _cfg(path, 16, 32, "actor_rollout_ref.model.override_config.sliding_window=null", *base,
               "reward_model.model.input_tokenizer=null")
    assert isinstance(cfg, PPOConfig)
    check_attention_windows(cfg)
    cfg.data.max_prompt_length = 40  # (the config validated at 16: what the check reads)
    with pytest.raises(ConfigError, match=r"^reward_model.model.path .* reach 72 tokens"):
        check_attention_windows(cfg)
    cfg = _cfg(path, 16, 32, "actor_rollout_ref.model.override_config.sliding_window=null", *base,
               f"reward_model.model.input_tokenizer={path}")
    with pytest.raises(ConfigError, match=r"have no length limit \(reward_model.max_length=null: .*set "
                                          r"reward_model.max_length \(a longer chat is cut on the right\) to at most "
                                          r"64 tokens"):
        check_attention_windows(cfg)
    cfg.reward_model.max_length = 64
    check_attention_windows(cfg)


@pytest.mark.parametrize("make", [_mistral, _qwen2])
def test_export_keeps_the_window(tmp_path, make):
    """`save_pretrained` (the export's writer) copies the window's keys through: transformers reloads the same
    windowed layers, with meshppo's logits within the window."""
    hf, path = make(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ours.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["sliding_window"] == hf.config.sliding_window
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert again.config.layer_types == hf.config.layer_types if hasattr(hf.config, "layer_types") else True
    assert _max_diff(ours, again, ours.args.attention_window) <= TOL
    assert _max_diff(ours, again, ours.args.attention_window + 1) > 1e-3


def test_rollout_generate_refuses_sequences_past_the_window(tmp_path, capsys):
    """`python -m rollout.generate`: the longest prompt + --max-new-tokens (or --max-model-len, where the engine
    stops) within the window generates; past it the command is refused before any work, naming the keys."""
    from rollout.generate import main

    _, path = _mistral(tmp_path)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": list(range(3, 43))}) + "\n")  # 40 tokens
    out = tmp_path / "out.jsonl"
    common = ["--model", str(path), "--prompts", str(prompts), "--out", str(out), "--temperature", "0", "--ignore-eos"]
    assert main(common + ["--max-new-tokens", "24"]) == 0
    assert len(json.loads(out.read_text())["token_ids"]) == 24
    out.unlink()
    assert main(common + ["--max-new-tokens", "25"]) == 2
    err = capsys.readouterr().err
    assert "config.json's sliding_window=64" in err and "65 tokens" in err and "--max-new-tokens" in err, err
    assert not out.exists()
    assert main(common + ["--max-new-tokens", "100", "--max-model-len", "64"]) == 0
