"""IBM Granite 3.x checkpoints (`model_type: granite`, `GraniteForCausalLM`) against transformers' implementation on
tiny random weights, in float64 on CPU: Llama's blocks with four scalars (the embeddings times embedding_multiplier,
each branch's output times residual_multiplier, the attention's scale attention_multiplier, the logits divided by
logits_scaling), each far from 1 so that a scalar left out fails; meshppo's model, its log-probs and entropy, its
engine, the trainer's loading path, the export, and what has no transformers class (a value model's export)."""

import dataclasses
import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (TOL, check_engine_greedy, check_export_round_trip, check_padded_and_packed_logits,
                                  check_hf_critic_refused_at_preflight, check_peft_adapter_round_trip, hf_causal_lm,
                                  one_thread, trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Far from 1, and the attention scale far from head_dim ** -0.5 (0.25 at head_dim 16): a scalar left out moves the
# logits by far more than TOL (test_each_scalar_acts)
SCALARS = dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09, logits_scaling=2.5)
# GQA (4 query heads on 2 KV heads), untied; one KV head with tied embeddings (granite-3.x-2b ties them); and
# attention_bias (q, k, v and, in transformers' Granite, o_proj biased) with mlp_bias
SHAPES = [dict(num_key_value_heads=2, tie_word_embeddings=False),
          dict(num_key_value_heads=1, tie_word_embeddings=True),
          dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)]


def _granite(dtype=torch.float64, **overrides):
    """transformers' GraniteForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, pad_token_id=0, bos_token_id=None,
              eos_token_id=2, **SCALARS)
    return hf_causal_lm(transformers.GraniteConfig, transformers.GraniteForCausalLM, dtype, **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _granite(**overrides)
    hf.save_pretrained(tmp_path / "granite")
    return hf, tmp_path / "granite"


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_granite(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    GraniteForCausalLM's (its four scalars read from config.json); its parameter count (the FLOP formula's) is
    transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.model_type == "granite" and ours.args.head_dim == 16
    assert {k: getattr(ours.args, k) for k in SCALARS} == SCALARS
    assert ours.args.embedding_scale == 3.0 and ours.args.attention_scale == 0.09
    assert ours.args.o_proj_bias == shape.get("attention_bias", False)
    assert ours.args.tie_word_embeddings == shape["tie_word_embeddings"]
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_each_scalar_acts(tmp_path):
    """Each of the four scalars at 1 (the attention's at head_dim ** -0.5) moves meshppo's logits far off
    transformers': the parity above holds only with every one of them where transformers puts it."""
    hf, path = _saved(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        assert (ours(ids) - ref).abs().max().item() <= TOL
        for key, neutral in (("embedding_multiplier", 1.0), ("residual_multiplier", 1.0),
                             ("attention_multiplier", 0.25), ("logits_scaling", 1.0)):
            other = Transformer(dataclasses.replace(ours.args, **{key: neutral}))
            other.load_state_dict(ours.state_dict())
            other.reset_buffers()
            assert (other.double()(ids) - ref).abs().max().item() > 1e-2, key


def test_log_probs_and_entropy_divide_the_logits_by_logits_scaling(tmp_path, monkeypatch):
    """The trainer's log-probs and entropy (`Transformer(labels=...)`, the chunked LM head, at a sampling
    temperature and at 0, greedy's, scored at 1) are those of transformers' logits (already divided by
    logits_scaling) at that temperature, in float64 (the head returns them in float32: 1e-5, where leaving
    logits_scaling out is off by > 1e-2)."""
    hf, path = _saved(tmp_path, **SHAPES[1])  # tied: the head through the embedding's weight
    untied_hf, untied_path = _saved(tmp_path / "u", **SHAPES[0])
    monkeypatch.setenv("MESHPPO_LM_HEAD", "torch")
    for ref_model, where in ((hf, path), (untied_hf, untied_path)):
        ours = Transformer.from_pretrained(where, dtype=torch.float64)
        ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))
        labels = torch.roll(ids, -1, 1)
        with torch.no_grad():
            logits = ref_model(input_ids=ids).logits
        for temperature in (0.7, 0.0):
            log_p = torch.log_softmax(logits / (temperature or 1.0), -1)
            ref_logp = log_p.gather(-1, labels[..., None])[..., 0]
            ref_ent = -(log_p.exp() * log_p).sum(-1)
            logp, ent = ours(ids, labels=labels, temperature=temperature, with_entropy=True, chunk_size=7)
            assert (logp - ref_logp).abs().max().item() <= 1e-5
            assert (ent - ref_ent).abs().max().item() <= 1e-5
            # a head that left logits_scaling out would be off by far more
            wrong = torch.log_softmax(logits * 2.5 / (temperature or 1.0), -1).gather(-1, labels[..., None])[..., 0]
            assert (wrong - ref_logp).abs().max().item() > 1e-2


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path, shape):
    """The engine on a Granite checkpoint (GQA; with attention_bias and mlp_bias: o_proj's bias before the residual
    scale; chunked prefill and preemption forced): greedy tokens are those of a no-cache loop over the training
    model, its log-probs the training forward's (the logits divided by logits_scaling), and transformers' logits
    pick the same tokens."""
    hf, path = _saved(tmp_path, **shape)
    check_engine_greedy(hf, path, VOCAB)


def test_engine_sampled_log_probs_divide_by_logits_scaling(tmp_path):
    """Sampling at a temperature with top-p: each token is the race winner over the training model's logits at
    that temperature (transformers', divided by logits_scaling) and its log-prob theirs; an engine sampler that
    left logits_scaling out would report log-probs off by > 1e-2."""
    from rollout import SamplingParams
    from tests.unit.test_engine import check_against_training_forward, make_engine

    _, path = _saved(tmp_path, **SHAPES[1])
    model = Transformer.from_pretrained(path, dtype=torch.float64).eval()
    engine = make_engine(model, dtype=torch.float64)
    assert engine.runner.sampler.logits_scaling == 2.5
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 11)]
    params = SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=8, seed=3)
    for out in engine.generate(prompts, params):
        check_against_training_forward(model, out, params, atol=1e-5)
        seq = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.no_grad():
            unscaled = model(seq)[0, len(out.prompt_token_ids) - 1:-1] * 2.5 / 0.8
        wrong = torch.log_softmax(unscaled, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert (wrong - torch.tensor(out.logprobs, dtype=torch.float64)).abs().max() > 1e-2


def test_a_saved_granite_directory_loads_through_the_trainers_model_path(tmp_path):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by the trainer's
    actor builder (FSDP on one gloo rank, and sharded over two: o_proj's and the MLP's biases too): every weight lands
    where transformers put it. verl's wrap policy may name GraniteDecoderLayer."""
    from sharding import FSDPConfig
    from tests.dist_utils import run_distributed

    assert FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["GraniteDecoderLayer"]})
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[2])
    assert json.loads((path / "config.json").read_text())["model_type"] == "granite"
    for world in (1, 2):
        run_distributed(trainer_loads_bit_for_bit, world, str(path), "granite", 16, unprefixed)


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trips_through_transformers_granite(tmp_path, shape):
    """The trained-policy export writes a directory transformers loads as GraniteForCausalLM with meshppo's logits
    (the four scalars written back); a value model's export is refused, transformers having no
    GraniteForTokenClassification."""
    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, again = check_export_round_trip(tmp_path, base, "Granite", VOCAB, token_classifier=False)
    assert written["model_type"] == "granite" and written["tie_word_embeddings"] == shape["tie_word_embeddings"]
    assert {k: written[k] for k in SCALARS} == SCALARS
    assert written["attention_bias"] == shape.get("attention_bias", False)
    assert written["mlp_bias"] == shape.get("mlp_bias", False)
    if written["attention_bias"]:
        assert again.model.layers[0].self_attn.o_proj.bias.abs().max() > 0


def test_granite_scalars_are_checked():
    """A scalar that is not a number > 0 is refused naming config.json's key; another type with one set is refused
    (its transformers class reads none); a Granite without attention_multiplier gets GraniteConfig's default, 1."""
    with pytest.raises(ValueError, match="config.json's logits_scaling: expected a number > 0, got 0"):
        ModelArgs(model_type="granite", logits_scaling=0)
    with pytest.raises(ValueError, match="config.json's residual_multiplier: expected a number > 0"):
        ModelArgs(model_type="granite", residual_multiplier=float("nan"))
    with pytest.raises(ValueError, match="embedding_multiplier is read for model_type granite / granitemoe / "
                                         "granitemoeshared only"):
        ModelArgs(model_type="llama", embedding_multiplier=12.0)
    assert ModelArgs(model_type="granite").attention_scale == 1.0
    assert ModelArgs(model_type="llama", head_dim=16).attention_scale == 0.25


def test_a_critic_written_as_a_hugging_face_directory_is_refused_at_the_pre_flight(tmp_path):
    """A Granite critic trains and its meshppo checkpoint keeps it; critic.checkpoint.save_contents with hf_model
    (a Hugging Face directory of the value model, which no transformers class reads back) is refused before the
    run, naming the key."""
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    check_hf_critic_refused_at_preflight(path, r"a granite value model cannot be written .*no "
                                               r"GraniteForTokenClassification, so")


def test_lora_all_linear_saves_as_peft_and_peft_loads_it_with_our_logits(tmp_path):
    """all-linear (verl's default) on a Granite adapts q_proj .. down_proj; save_peft_adapter writes peft's adapter,
    which PeftModel.from_pretrained on GraniteForCausalLM reads with meshppo's logits (the scalars on the adapted
    model too), and which reads back (lora_adapter_path) into the same adapters."""
    hf, path = _saved(tmp_path, **SHAPES[2])
    check_peft_adapter_round_trip(tmp_path, hf, path, "granite", VOCAB,
                                  ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                                  adapted=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def test_checkpoints_of_other_types_keep_their_fingerprint():
    """A training checkpoint records the model's fingerprint and resuming compares it whole: another type's is the
    one meshppo recorded before Granite's scalars existed (so its checkpoints resume), a Granite's holds the scalars
    (so a checkpoint does not resume on other ones)."""
    qwen2 = ModelArgs(vocab_size=128, hidden_size=32, num_hidden_layers=1, model_type="qwen2", attention_bias=True)
    assert qwen2.fingerprint == {  # as a checkpoint written before Granite recorded it
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": True, "mlp_bias": False,
        "tie_word_embeddings": False, "model_type": "qwen2", "initializer_range": 0.02, "bos_token_id": None,
        "eos_token_id": None, "pad_token_id": None, "extra_hf": None}
    granite = ModelArgs(vocab_size=128, hidden_size=32, num_hidden_layers=1, model_type="granite", **SCALARS)
    assert {k: granite.fingerprint[k] for k in SCALARS} == SCALARS
    assert granite.fingerprint != dataclasses.replace(granite, logits_scaling=8.0).fingerprint


def test_fp8_rollout_runs_granite():
    """fp8 rollout on a Granite (o_proj's and the MLP's biases, the four scalars): the engine's log-probs are those of
    the training model computing what fp8 should (each norm folded into the e4m3 projections after it, the inputs
    rounded to e4m3), as test_fp8_rollout holds the other types to; the residual scale applies to fp8 down_proj's
    scaled rows too."""
    from rollout import SamplingParams
    from tests.unit.test_engine import make_engine, prompts_of, tiny_args, tiny_model
    from tests.unit.test_fp8_rollout import _fake_quant_reference, _logprob_errors

    model = tiny_model(tiny_args("llama", model_type="granite", attention_bias=True, **SCALARS))
    engine = make_engine(model, quantization="fp8")
    outs = engine.generate(prompts_of([3 + i % 12 for i in range(16)]),
                           SamplingParams(temperature=1.0, max_tokens=4, seed=3, ignore_eos=True))
    assert _logprob_errors(_fake_quant_reference(model), outs).median().item() < 1e-4
    assert _logprob_errors(model, outs).mean().item() > 0.01  # the quantization is real
