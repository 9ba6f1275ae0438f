"""YaRN rope scaling (`rope_scaling: {rope_type: yarn, ...}`, Qwen2.5's and Qwen3's long-context
setting): the training model's logits equal transformers' on the same config.json (float32), at
positions past `original_max_position_embeddings`, and the engine generates what the training model
scores (greedy tokens and log-probs)."""

import json
import math

import pytest
import torch

from models import ModelArgs, Transformer
from models.transformer import rope_inv_freq
from rollout import SamplingParams
from tests.unit.test_engine import (check_against_training_forward, greedy_reference, make_engine, prompts_of,
                                    tiny_args, tiny_model)

transformers = pytest.importorskip("transformers")

TOL = 1e-4  # float32 logits (|logit| ~5) of two implementations of the same model: ~5e-6 apart
SEQ = 40

YARN_VARIANTS = [
    # Qwen2.5's model card, as its config.json writes it (transformers v4's `type` key)
    ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1_000_000.0),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}, 10000.0),
    # without original_max_position_embeddings: transformers takes max_position_embeddings
    ({"rope_type": "yarn", "factor": 2.0}, 10000.0),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2,
      "truncate": False}, 10000.0),
    # DeepSeek's form: the attention factor is mscale's over mscale_all_dim's
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
      "mscale_all_dim": 1.0}, 10000.0),
    # mscale alone is not read (the attention factor is factor's)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 2.0}, 10000.0),
    ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16, "attention_factor": 1.5}, 500.0),
]


def hf_rope_checkpoint(tmp_path, kind: str, rope_scaling: dict, rope_theta: float, max_position_embeddings: int = 64):
    """A tiny random transformers checkpoint whose config.json carries `rope_scaling` as written
    (v4's keys: transformers reads them as a hand-written config.json's)."""
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_position_embeddings)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # weights large enough that the positions weigh on the logits (biases too)
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.15)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config.update(rope_theta=rope_theta, rope_scaling=rope_scaling)
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("rope_scaling, rope_theta", YARN_VARIANTS)
def test_yarn_logits_match_transformers_past_the_original_context(tmp_path, kind, rope_scaling, rope_theta):
    path = hf_rope_checkpoint(tmp_path, kind, rope_scaling, rope_theta)
    ours = Transformer.from_pretrained(path)
    assert ours.args.rope_type == "yarn"
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    original = rope_scaling.get("original_max_position_embeddings", 64)
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, SEQ))
    positions = torch.arange(SEQ) + original - SEQ // 2  # half before the original context's end, half past it
    positions = torch.stack([positions, positions + 7])
    with torch.no_grad():
        expected = reference(input_ids=ids, position_ids=positions).logits
        got = ours(ids, position_ids=positions)
        unscaled = Transformer.from_pretrained(hf_rope_checkpoint(tmp_path / "plain", kind, None, rope_theta))
        assert (unscaled(ids, position_ids=positions) - got).abs().max() > 1000 * TOL  # yarn changes the logits
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("rope_scaling, attention_factor", [
    ({"factor": 4.0}, 1 + 0.1 * math.log(4.0)),
    ({"factor": 1.0}, 1.0),  # no longer context: no scale
    ({"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 1.0}, (1 + 0.0707 * math.log(4.0)) / (1 + 0.1 * math.log(4.0))),
    ({"factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0}, 1 + 0.1 * math.log(4.0)),  # 0: unset
    ({"factor": 4.0, "attention_factor": 0.8, "mscale": 1.0, "mscale_all_dim": 2.0}, 0.8),  # given: it is taken
])
def test_yarn_attention_factor_is_the_papers(rope_scaling, attention_factor):
    """0.1·ln(factor) + 1 (YaRN, eq. 21), or mscale's over mscale_all_dim's, or attention_factor as given."""
    args = ModelArgs(head_dim=16, rope_scaling={"rope_type": "yarn", **rope_scaling})
    assert rope_inv_freq(args).attention_factor == pytest.approx(attention_factor, rel=1e-12)


def test_yarn_frequencies_blend_interpolation_and_extrapolation():
    """Hand-computed in float64: head_dim 16, theta 10000, original context 64, factor 4. The
    dimension turning b times over 64 positions is 16·ln(64 / (2πb)) / (2·ln 10000): 0.09 for b=32
    (floor 0), 2.02 for b=1 (ceil 3); frequency i keeps the share 1 - clamp(i / 3, 0, 1) of its
    own value, the rest divided by 4."""
    args = ModelArgs(head_dim=16, max_position_embeddings=1024,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    base = [10000.0 ** (-2 * i / 16) for i in range(8)]
    kept = [1 - min(i / 3, 1.0) for i in range(8)]
    expected = torch.tensor([b * k + b / 4 * (1 - k) for b, k in zip(base, kept)], dtype=torch.float64)
    torch.testing.assert_close(rope_inv_freq(args).inv_freq.double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_generates_what_the_yarn_model_scores(kind):
    """Greedy tokens equal a no-cache loop through the training model, and log-probs its log-softmax,
    with prompts and responses running past the original context of 8 positions."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    model = tiny_model(tiny_args(kind, eos_token_id=None, rope_scaling=yarn))
    prompts = prompts_of([3, 11, 26])
    engine = make_engine(model, max_num_batched_tokens=16)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(model, prompt, 12)
        check_against_training_forward(model, out, SamplingParams(temperature=0))


@pytest.mark.parametrize("rope_scaling, message", [
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": 1.0, "beta_slow": 8.0}, "beta_fast must not be below beta_slow"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, "low_freq_factor must be below high_freq_factor"),
])
def test_reversed_rope_parameters_are_refused_from_config_json_as_from_an_override(rope_scaling, message):
    """The relations a rope type's frequencies need are checked wherever the mapping comes from: an
    override refused it while the same mapping in config.json was built into a model."""
    from models import ModelArgs
    from models.args import apply_overrides

    with pytest.raises(ValueError, match=rf"^rope_scaling: {message}"):
        ModelArgs(rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=rf"override_config.rope_scaling: {message}"):
        apply_overrides(ModelArgs(), {"rope_scaling": rope_scaling})
