"""Gemma 2 checkpoints (`model_type: gemma2`, `Gemma2ForCausalLM`) and the logit soft caps against transformers'
implementation on tiny random weights, in float64 on CPU: meshppo's model (Gemma 3's architecture without its q / k
norms, one RoPE for every layer, alternating sliding and full layers, the attention scores and the logits
soft-capped), its gradients, the log-probs, its engine, the trainer's loading path, the export, LoRA, a Gemma 3
with a logit cap, and what meshppo refuses.

The caps are small (attention 2, logits 1.5) so that they bite on tiny random weights: at Gemma 2's own 50 and 30
the tanh is the identity there to 1e-6 and a test would pass without them. transformers' reference runs its eager
attention with the softmax in float64 (`hf_family.EAGER_FLOAT64`): its sdpa drops the attention cap."""

import json

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths
from tests.unit.hf_family import (EAGER_FLOAT64, TOL, check_engine_greedy, check_export_round_trip,
                                  check_padded_and_packed_logits, check_peft_adapter_round_trip,
                                  check_reward_model_score, hf_causal_lm, one_thread, trainer_loads_bit_for_bit,
                                  unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
CAPS = dict(attn_logit_softcapping=2.0, final_logit_softcapping=1.5)
# A window (6) far shorter than the test sequences (40) on the sliding layers (Gemma2Config's default layer_types:
# 0 and 2 sliding, 1 full). Explicit head_dim (24 against hidden / heads 16) with GQA and tied embeddings (Gemma 2's);
# one KV head, untied, attention_bias (transformers' Gemma2 then biases o_proj too), four layers.
SHAPES = [dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
          dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, attention_bias=True,
               num_hidden_layers=4)]


def _gemma2(dtype=torch.float64, **overrides):
    """transformers' Gemma2ForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=256, query_pre_attn_scalar=20,
              sliding_window=6, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rms_norm_eps=1e-6,
              pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, **CAPS)
    return hf_causal_lm(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dtype, EAGER_FLOAT64,
                        **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _gemma2(**overrides)
    hf.save_pretrained(tmp_path / "gemma2")
    return hf, tmp_path / "gemma2"


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_gemma2(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences longer than the window: meshppo's
    logits are Gemma2ForCausalLM's (both caps acting); its parameter count (the FLOP formula's) is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    a = ours.args
    assert a.model_type == "gemma2" and a.head_dim == shape["head_dim"]
    assert a.sandwich_norm and a.unit_offset_norm and not a.qk_norm and not a.full_qk_norm and not a.post_norm
    assert a.attention_scale == 20 ** -0.5 and a.embedding_scale == 8.0 and a.mlp_activation == "gelu_tanh"
    assert (a.attn_logit_softcapping, a.final_logit_softcapping) == (2.0, 1.5)
    assert a.layer_types == hf.config.layer_types and a.local_rope_layers == []
    assert a.layer_windows == [6 if k == "sliding_attention" else None for k in hf.config.layer_types]
    assert a.layer_windows[:2] == [6, None]  # Gemma2Config's default: the even layers slide
    assert a.o_proj_bias == shape.get("attention_bias", False)
    assert a.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def _hf_grads(hf, loss):
    hf.zero_grad()
    loss.backward()
    return {k.removeprefix("model."): p.grad for k, p in hf.named_parameters()}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_gradients_equal_transformers_gemma2(tmp_path, layout):
    """Every parameter's gradient of a weighted sum of the logits (padded with left padding, or packed sequences
    longer than the window) is Gemma2ForCausalLM's: the capped scores' and logits' derivatives included. (No pad
    token in the input: transformers' embedding holds the pad id's row at a zero gradient, which meshppo's does
    not.)"""
    hf, path = _saved(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    if layout == "padded":
        ids = torch.randint(1, VOCAB, (2, 30), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :9] = 0
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        weights = torch.randn(2, 30, VOCAB, generator=g, dtype=torch.float64) * mask[..., None]
        ref = _hf_grads(hf, (hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits * weights).sum())
        (ours(ids, position_ids=pos, attention_mask=mask) * weights).sum().backward()
    else:
        lengths = [11, 23, 4]
        seqs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
        weights = [torch.randn(n, VOCAB, generator=g, dtype=torch.float64) for n in lengths]
        ref = _hf_grads(hf, sum((hf(input_ids=s[None]).logits[0] * w).sum() for s, w in zip(seqs, weights)))
        (ours(torch.cat(seqs)[None], cu_seqlens=cu_seqlens_from_lengths(lengths))[0] * torch.cat(weights)).sum() \
            .backward()
    got = dict(ours.named_parameters())
    assert got.keys() == ref.keys()
    for name, p in got.items():
        # A norm weight's gradient is a float32 sum over the rows (both norms work in float32, as Gemma2RMSNorm
        # does), summed in another order over packed rows than over transformers' sequences: float32's rounding
        tol = 1e-5 if "norm" in name and layout == "packed" else TOL
        assert (p.grad - ref[name]).abs().max().item() <= tol * max(1.0, ref[name].abs().max().item()), name


def test_each_cap_shows_in_the_logits(tmp_path):
    """Each soft cap moves the logits far above the tolerance (without it the tests above fail), as the window, the
    attention scale and Gemma 2's alternating layers do."""
    import dataclasses

    hf, path = _saved(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    base = Transformer.from_pretrained(path, dtype=torch.float64)
    changes = {"attention cap": dict(attn_logit_softcapping=None), "final cap": dict(final_logit_softcapping=None),
               "window": dict(extra_hf=base.args.extra_hf | {"sliding_window": 1000}),
               "scale": dict(extra_hf=base.args.extra_hf | {"query_pre_attn_scalar": 24}),
               "layer types": dict(extra_hf=base.args.extra_hf | {"layer_types": ["full_attention"] * 3})}
    for what, change in changes.items():
        other = Transformer(dataclasses.replace(base.args, **change)).double()
        other.load_state_dict(base.state_dict())
        other.reset_buffers()
        with torch.no_grad():
            assert (other(ids) - ref).abs().max() > 1e-3, what


@pytest.mark.parametrize("tied", [True, False])
def test_log_probs_and_entropy_are_those_of_the_capped_logits(tmp_path, tied):
    """The trainer's chunked LM head (labels given; temperature 0.7) caps the logits before the temperature:
    its log-probs and entropies are log_softmax(transformers' logits / 0.7)'s (the head works in float32), and
    their gradients with respect to the final hidden states those of that float64 formula."""
    hf, path = _saved(tmp_path, tie_word_embeddings=tied)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(8))
    labels = torch.roll(ids, -1, 1)
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=ids).logits / 0.7, -1)
    logp, ent = ours(ids, labels=labels, temperature=0.7, with_entropy=True, chunk_size=7)
    assert (logp.double() - ref.gather(-1, labels[..., None])[..., 0]).abs().max().item() <= 1e-5
    assert (ent.double() + (ref.exp() * ref).sum(-1)).abs().max().item() <= 1e-5
    h = ours.hidden_states(ids).detach().requires_grad_()
    w = ours.lm_head_weight
    g = torch.randn(2, 30, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (ours._head(h, labels, 0.7, False, 7, None, False)[0] * g).sum().backward()
    got = h.grad
    h.grad = None
    exact = torch.log_softmax(torch.tanh((h @ w.detach().t()) / 1.5) * 1.5 / 0.7, -1)
    (exact.gather(-1, labels[..., None])[..., 0] * g).sum().backward()
    assert (got - h.grad).abs().max().item() <= 1e-5 * max(1.0, h.grad.abs().max().item())


def test_an_older_config_json_is_read_as_transformers_reads_it():
    """A config.json as the hub's gemma-2 checkpoints have it (rope_theta at the top level, no layer_types, the caps
    given; hidden_act beside hidden_activation) is read as Gemma2Config reads it; without the caps, Gemma2Config's
    defaults (50, 30); a ModelArgs written back is that config."""
    old = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e4, sliding_window=512,
               query_pre_attn_scalar=16, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    raw = ModelArgs.from_hf_config(old)
    via_hf = ModelArgs.from_hf_config(transformers.Gemma2Config(**{k: v for k, v in old.items()
                                                                   if k not in ("model_type", "rope_theta")},
                                                                rope_parameters={"rope_theta": 1e4}))
    for a in (raw, via_hf):
        assert a.layer_types == ["sliding_attention", "full_attention"] * 2 + ["sliding_attention"]
        assert a.windowed_layers == [0, 2, 4] and a.sliding_window == 512 and a.local_rope_layers == []
        assert (a.rope_theta, a.rope_type, a.attn_logit_softcapping, a.final_logit_softcapping) == (1e4, "default",
                                                                                                   50.0, 30.0)
        back = a.to_hf_config()
        assert type(back).__name__ == "Gemma2Config" and back.layer_types == a.layer_types
        assert back.rope_parameters["rope_theta"] == 1e4 and back.query_pre_attn_scalar == 16
        assert (back.attn_logit_softcapping, back.final_logit_softcapping) == (50.0, 30.0)
        assert back.hidden_activation == "gelu_pytorch_tanh" and back.sliding_window == 512
    defaults = ModelArgs.from_hf_config({k: v for k, v in old.items() if "softcapping" not in k})
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (50.0, 30.0)
    none = ModelArgs.from_hf_config(old | {"attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert none.attn_logit_softcapping is none.final_logit_softcapping is None
    assert none.to_hf_config().final_logit_softcapping is None


def test_a_checkpoint_records_the_caps_and_the_attention_scale():
    """A training checkpoint's fingerprint (what a resume compares) holds the caps and query_pre_attn_scalar: each
    changes the logits, as rope_theta does; an uncapped model's records no cap (a checkpoint written before the
    caps existed resumes)."""
    kw = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    base = ModelArgs.from_hf_config(kw)
    assert {k: base.fingerprint[k] for k in ("attn_logit_softcapping", "final_logit_softcapping",
                                             "query_pre_attn_scalar")} == {
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}
    for key, value in (("attn_logit_softcapping", 40.0), ("final_logit_softcapping", None),
                       ("query_pre_attn_scalar", 20)):
        assert ModelArgs.from_hf_config(kw | {key: value}).fingerprint != base.fingerprint, key
    assert "final_logit_softcapping" not in ModelArgs(model_type="llama").fingerprint
    assert "attn_logit_softcapping" not in ModelArgs(model_type="gemma3_text").fingerprint


@pytest.mark.parametrize("key,value,match", [
    ("attn_logit_softcapping", 0.0, "config.json's attn_logit_softcapping \\(null: none\\): expected a number > 0"),
    ("final_logit_softcapping", -30.0, "config.json's final_logit_softcapping \\(null: none\\): expected a number > 0"),
    ("use_bidirectional_attention", True, "config.json's use_bidirectional_attention=True is not supported for "
                                          "gemma2"),
    ("hidden_activation", "gelu", "hidden_activation='gelu' is not supported for gemma2")])
def test_bad_values_are_refused_naming_the_key(key, value, match):
    kw = dict(model_type="gemma2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(kw | {key: value})


def test_a_cap_on_another_type_is_refused():
    """A type whose transformers model caps nothing refuses a cap (set on ModelArgs, or by an override) naming it."""
    with pytest.raises(ValueError, match=r"final_logit_softcapping=30.0 \(config.json.s, or a model.override_config.s\) "
                                         "is not supported for llama"):
        ModelArgs(model_type="llama", final_logit_softcapping=30.0)


def test_override_config_sets_or_removes_a_cap(tmp_path):
    """verl's `model.override_config` sets a cap on the Hugging Face config before the model is built: meshppo's logits
    with `attn_logit_softcapping: null` and `final_logit_softcapping: 4` are Gemma2ForCausalLM's with its config so
    set (and differ from the checkpoint's caps'); a cap that is not null or positive, and a cap on a type that reads
    none, are refused naming the key."""
    from models.args import apply_overrides, check_overrides

    hf, path = _saved(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    overrides = {"attn_logit_softcapping": None, "final_logit_softcapping": 4}
    args = apply_overrides(ours.args, overrides)
    assert (args.attn_logit_softcapping, args.final_logit_softcapping) == (None, 4.0)
    overridden = Transformer(args).double()
    overridden.load_state_dict(ours.state_dict())
    overridden.reset_buffers()
    hf.config.attn_logit_softcapping, hf.config.final_logit_softcapping = None, 4.0
    for layer in hf.model.layers:  # its attention reads the config's cap when it is built
        layer.self_attn.attn_logit_softcapping = None
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        assert (overridden(ids) - theirs).abs().max() <= 1e-9
        assert (ours(ids) - theirs).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"override_config.final_logit_softcapping \(null: none\): expected a number > "
                                         "0, got 0"):
        check_overrides({"final_logit_softcapping": 0})
    with pytest.raises(ValueError, match=r"attn_logit_softcapping=50.0 \(config.json's, or a model.override_config's\) "
                                         "is not supported for llama"):
        apply_overrides(ModelArgs(model_type="llama"), {"attn_logit_softcapping": 50})


def test_a_null_window_with_sliding_layers_is_refused_and_none_is_gemma2s_default():
    with pytest.raises(ValueError, match=r"sliding_window=null \(config.json's, or a model.override_config's\) is not "
                                         "supported for gemma2"):
        ModelArgs(model_type="gemma2", extra_hf={"sliding_window": None})
    args = ModelArgs(model_type="gemma2", num_hidden_layers=3)
    assert args.layer_windows == [4096, None, 4096] and args.to_hf_config().sliding_window == 4096


@pytest.mark.parametrize("shape", SHAPES)
def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path, shape):
    """The engine on a Gemma 2 checkpoint (chunked prefill and preemption forced; prompts and outputs past the
    window): greedy tokens are those of a no-cache loop over the training model, its log-probs the training
    forward's (capped logits), and transformers' logits pick the same tokens, each log-prob log_softmax of them."""
    hf, path = _saved(tmp_path, **shape)
    check_engine_greedy(hf, path, VOCAB)


def test_engine_sampled_log_probs_are_transformers_capped_logits_over_the_temperature(tmp_path):
    """At temperature 0.7 the engine's sampled tokens' log-probs are log_softmax(transformers' logits / 0.7): the
    logits capped first, then divided by the temperature, as verl divides the capped logits of its actor."""
    from rollout import SamplingParams
    from tests.unit.test_engine import make_engine

    hf, path = _saved(tmp_path)
    engine = make_engine(Transformer.from_pretrained(path, dtype=torch.float64).eval(), dtype=torch.float64)
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11)]
    outs = engine.generate(prompts, SamplingParams(temperature=0.7, n=2, max_tokens=12, seed=3, ignore_eos=True))
    for out in outs:
        prompt = prompts[out.prompt_index]
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-6


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_gemma2_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by the trainer's
    actor builder (FSDP on one gloo rank, and sharded over two): every weight lands where transformers put it."""
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[1])
    from tests.dist_utils import run_distributed

    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma2"
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "gemma2", 16, unprefixed)


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trips_through_transformers_gemma2(tmp_path, shape):
    """The trained-policy export writes a directory transformers loads as Gemma2ForCausalLM with meshppo's logits
    (its caps, layer types, window and query_pre_attn_scalar); a value model exports as Gemma2ForTokenClassification
    with its scores."""
    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, again = check_export_round_trip(tmp_path, base, "Gemma2", VOCAB,
                                             hf_kwargs={"attn_implementation": EAGER_FLOAT64})
    assert written["model_type"] == "gemma2" and written["tie_word_embeddings"] == shape["tie_word_embeddings"]
    assert written["query_pre_attn_scalar"] == 20 and written["sliding_window"] == 6
    assert (written["attn_logit_softcapping"], written["final_logit_softcapping"]) == (2.0, 1.5)
    assert written["layer_types"] == again.config.layer_types and "hidden_act" not in written


def test_fp8_rollout_is_refused_for_gemma2():
    from rollout.model import EngineModel
    from rollout.parallel import TPGroup

    with pytest.raises(ValueError, match="fp8 rollout is not supported for model_type gemma2"):
        EngineModel(ModelArgs(model_type="gemma2"), TPGroup(), torch.float32, torch.device("cpu"), 64,
                    quantization="fp8")


def test_lora_all_linear_saves_as_peft_and_peft_loads_it_with_our_logits(tmp_path):
    """all-linear on a Gemma 2 adapts q_proj .. down_proj; peft's adapter on Gemma2ForCausalLM gives meshppo's
    (capped) logits; exclude_modules may name its pre_feedforward_layernorm."""
    from models.lora import LoRAConfig, model_targets

    hf, path = _saved(tmp_path)
    ours = check_peft_adapter_round_trip(
        tmp_path, hf, path, "gemma2", VOCAB, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                              "v_proj"])
    assert model_targets(LoRAConfig(4, 8.0, exclude_modules=["pre_feedforward_layernorm"]), ours.args)


def test_a_gemma2_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """A Gemma2ForSequenceClassification directory (num_labels 1) loads as meshppo's value model: its score at a
    sequence's last token is transformers' logit (the attention cap acting; a classifier has no logit cap)."""
    cfg = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_labels=1,
                                    pad_token_id=0, sliding_window=6, query_pre_attn_scalar=20, **CAPS)
    hf = hf_causal_lm(lambda **kw: cfg, transformers.Gemma2ForSequenceClassification,
                      attn_implementation=EAGER_FLOAT64)
    check_reward_model_score(tmp_path, hf, VOCAB)


def test_gemma3_with_a_final_cap_equals_transformers_and_an_attention_cap_is_refused(tmp_path):
    """A Gemma 3 text config with final_logit_softcapping (Gemma3ForCausalLM caps its logits; meshppo refused it) gets
    Gemma3ForCausalLM's logits over padded and packed batches, the cap moving them far above the tolerance. Its
    attn_logit_softcapping is refused naming the key: transformers' Gemma3 attention never applies it. (A cap of 3:
    the padded check holds the logits decisive, above 1.)"""
    import dataclasses

    from models.checkpoint import load_model_args

    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=20, sliding_window=6,
               layer_types=["sliding_attention", "full_attention", "sliding_attention"], pad_token_id=0,
               final_logit_softcapping=3.0)
    hf = hf_causal_lm(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, **cfg)
    hf.save_pretrained(tmp_path / "g3")
    ours = Transformer.from_pretrained(tmp_path / "g3", dtype=torch.float64)
    assert (ours.args.attn_logit_softcapping, ours.args.final_logit_softcapping) == (None, 3.0)
    check_padded_and_packed_logits(hf, ours, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    other = Transformer(dataclasses.replace(ours.args, final_logit_softcapping=None)).double()
    other.load_state_dict(ours.state_dict())
    other.reset_buffers()
    with torch.no_grad():
        assert (other(ids) - hf(input_ids=ids).logits).abs().max() > 1e-3
    hf.config.attn_logit_softcapping = 50.0
    hf.config.save_pretrained(tmp_path / "g3")
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 \\(config.json's, or a model.override_config's\\) "
                                         "is not supported for gemma3_text \\(transformers' Gemma3Attention keeps it but "
                                         "never passes it"):
        load_model_args(tmp_path / "g3")
