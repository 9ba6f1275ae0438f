"""Gemma 3 text checkpoints (`model_type: gemma3_text`, `Gemma3ForCausalLM`) against transformers' implementation on
tiny random weights, in float64 on CPU: meshppo's model (norms by 1 + weight, four of them a block, per-head q / k
norms, a GeGLU MLP, the embedding scaled by sqrt(hidden), query_pre_attn_scalar's attention scale, sliding and full
layers each with its RoPE), its engine, the trainer's loading path, the export, LoRA, and what meshppo refuses."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (TOL, check_engine_greedy, check_export_round_trip, check_padded_and_packed_logits,
                                  check_peft_adapter_round_trip, check_reward_model_score, hf_causal_lm, one_thread,
                                  trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Layer types of the three layers: a window (6) far shorter than the test sequences (40) on the sliding ones, whose
# RoPE base (10,000) is not the full layer's (1e6, linear-scaled by 4 as gemma-3-4b's by 8).
LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
ROPE = {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
# Explicit head_dim (24 against hidden / heads 16) with GQA and tied embeddings (Gemma 3's); one KV head, untied,
# attention_bias (transformers' Gemma3 then biases o_proj too), the default layer pattern (5 sliding, 1 full).
SHAPES = [dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=True),
          dict(num_key_value_heads=1, head_dim=16, tie_word_embeddings=False, attention_bias=True, layer_types=None,
               num_hidden_layers=6)]


def _gemma3(dtype=torch.float64, **overrides):
    """transformers' Gemma3ForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=24, max_position_embeddings=256, query_pre_attn_scalar=20,
              sliding_window=6, layer_types=LAYERS, rope_parameters=ROPE, rms_norm_eps=1e-6, pad_token_id=0,
              eos_token_id=1, bos_token_id=2, tie_word_embeddings=True)
    return hf_causal_lm(transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dtype, **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _gemma3(**overrides)
    hf.save_pretrained(tmp_path / "gemma3")
    return hf, tmp_path / "gemma3"


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_gemma3(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences longer than the window: meshppo's
    logits are Gemma3ForCausalLM's; its parameter count (the FLOP formula's) is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    a = ours.args
    assert a.model_type == "gemma3_text" and a.head_dim == shape["head_dim"]
    assert a.sandwich_norm and a.unit_offset_norm and a.qk_norm and not a.full_qk_norm and not a.post_norm
    assert a.attention_scale == 20 ** -0.5 and a.embedding_scale == 8.0 and a.mlp_activation == "gelu_tanh"
    assert a.layer_types == hf.config.layer_types and a.local_rope_layers == [
        i for i, k in enumerate(hf.config.layer_types) if k == "sliding_attention"]
    assert a.layer_windows == [6 if k == "sliding_attention" else None for k in hf.config.layer_types]
    assert (a.rope_theta, a.rope_scaling, a.local_rope_args().rope_theta) == (1e6, {"rope_type": "linear",
                                                                                    "factor": 4.0}, 1e4)
    assert a.o_proj_bias == shape.get("attention_bias", False)
    assert ours.layers[0].self_attn.q_norm.weight.shape == (a.head_dim,)
    assert a.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_each_part_of_the_gemma3_architecture_shows_in_the_logits(tmp_path):
    """Each difference from a Llama moves the logits far above the tolerance: without it the test above fails."""
    import dataclasses

    hf, path = _saved(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
    base = Transformer.from_pretrained(path, dtype=torch.float64)
    changes = {"window": dict(extra_hf=base.args.extra_hf | {"sliding_window": 1000}),
               "local rope": dict(extra_hf=base.args.extra_hf | {"rope_local_base_freq": 1e6}),
               "scale": dict(extra_hf=base.args.extra_hf | {"query_pre_attn_scalar": 24})}
    for what, change in changes.items():
        other = Transformer(dataclasses.replace(base.args, **change)).double()
        other.load_state_dict(base.state_dict())
        other.reset_buffers()
        with torch.no_grad():
            assert (other(ids) - ref).abs().max() > 1e-3, what


def test_default_layer_types_and_an_older_config_json_are_read_as_transformers_reads_them():
    """A config.json before transformers v5 (rope_theta, rope_local_base_freq and rope_scaling at the top level, no
    layer_types: every sixth layer full) is read as Gemma3TextConfig reads it; a ModelArgs written back is that
    config."""
    old = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
               num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window=512,
               query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")
    raw = ModelArgs.from_hf_config(old)
    via_hf = ModelArgs.from_hf_config(transformers.Gemma3TextConfig(**{k: v for k, v in old.items()
                                                                       if k != "model_type"}))
    for a in (raw, via_hf):
        assert a.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]
        assert a.windowed_layers == [0, 1, 2, 3, 4, 6] and a.sliding_window == 512
        assert (a.rope_theta, a.rope_type, a.local_rope_args().rope_theta) == (1e6, "linear", 1e4)
        back = a.to_hf_config()
        assert type(back).__name__ == "Gemma3TextConfig" and back.layer_types == a.layer_types
        assert back.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
        assert back.rope_parameters["full_attention"]["factor"] == 8.0 and back.query_pre_attn_scalar == 16
        assert back.hidden_activation == "gelu_pytorch_tanh" and back.sliding_window == 512


def test_a_checkpoint_records_the_attention_scale_and_the_local_rope_base():
    """A training checkpoint's fingerprint (what a resume compares) holds a Gemma 3's query_pre_attn_scalar and
    rope_local_base_freq, read from extra_hf: each changes the logits, as rope_theta does; the window does not enter
    it (as for every type)."""
    kw = dict(model_type="gemma3_text", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"], hidden_activation="gelu_pytorch_tanh")
    base = ModelArgs.from_hf_config(dict(kw, query_pre_attn_scalar=16, rope_local_base_freq=1e4))
    assert {k: base.fingerprint[k] for k in ("query_pre_attn_scalar", "rope_local_base_freq")} == {
        "query_pre_attn_scalar": 16, "rope_local_base_freq": 1e4}
    for key, value in (("query_pre_attn_scalar", 20), ("rope_local_base_freq", 1e3)):
        other = ModelArgs.from_hf_config(dict(kw, **{"query_pre_attn_scalar": 16, "rope_local_base_freq": 1e4,
                                                     key: value}))
        assert other.fingerprint != base.fingerprint, key
    assert ModelArgs.from_hf_config(dict(kw, sliding_window=4, query_pre_attn_scalar=16,
                                         rope_local_base_freq=1e4)).fingerprint == base.fingerprint


@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)])
def test_what_meshppo_does_not_compute_is_refused_naming_the_key(tmp_path, key, value):
    """An attention soft cap (which transformers' Gemma3 never applies: test_gemma2.py) or bidirectional attention
    would give other logits than transformers': refused at load, naming config.json's key."""
    from models.checkpoint import load_model_args

    _, path = _saved(tmp_path, **{key: value})
    where = " \\(config.json's, or a model.override_config's\\)" if key == "attn_logit_softcapping" else ""
    with pytest.raises(ValueError, match=f"{key}={value!r}{where} is not supported for gemma3_text"):
        load_model_args(path)


def test_a_null_window_with_sliding_layers_is_refused_and_none_is_gemma3s_default():
    """transformers' Gemma3 cannot run a sliding_attention layer without a window (its cache fails): refused, naming
    the key; a config without one (a ModelArgs built here) windows by Gemma3TextConfig's default, 4096, and writes it."""
    with pytest.raises(ValueError, match=r"sliding_window=null \(config.json's, or a model.override_config's\) is not "
                                         "supported for gemma3_text"):
        ModelArgs(model_type="gemma3_text", extra_hf={"sliding_window": None})
    assert ModelArgs(model_type="gemma3_text", extra_hf={"sliding_window": None,
                                                         "layer_types": ["full_attention"] * 2}).attention_window is None
    args = ModelArgs(model_type="gemma3_text", num_hidden_layers=7)
    assert args.layer_windows == [4096] * 5 + [None, 4096] and args.to_hf_config().sliding_window == 4096


def test_another_activation_is_refused():
    with pytest.raises(ValueError, match="hidden_activation='gelu' is not supported for gemma3_text"):
        ModelArgs.from_hf_config(transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                               hidden_activation="gelu"))


@pytest.mark.parametrize("shape", SHAPES)
def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path, shape):
    """The engine on a Gemma 3 checkpoint (chunked prefill and preemption forced; prompts and outputs past the
    window): greedy tokens are those of a no-cache loop over the training model, its log-probs the training
    forward's, and transformers' logits pick the same tokens."""
    hf, path = _saved(tmp_path, **shape)
    check_engine_greedy(hf, path, VOCAB)


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_gemma3_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by the trainer's
    actor builder (FSDP on one gloo rank, and sharded over two): every weight (the 0-centred norms as stored) lands
    where transformers put it. verl's wrap policy may name Gemma3DecoderLayer."""
    from sharding import FSDPConfig
    from tests.dist_utils import run_distributed

    assert FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["Gemma3DecoderLayer"]})
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[1])
    assert json.loads((path / "config.json").read_text())["model_type"] == "gemma3_text"
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "gemma3_text", 16, unprefixed)


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trips_through_transformers_gemma3(tmp_path, shape):
    """The trained-policy export writes a directory transformers loads as Gemma3ForCausalLM with meshppo's logits
    (its layer types, window, both RoPE bases and query_pre_attn_scalar); a value model's export is refused,
    transformers having no Gemma3 token classifier."""
    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, again = check_export_round_trip(tmp_path, base, "Gemma3", VOCAB, token_classifier=False)
    assert written["model_type"] == "gemma3_text" and written["tie_word_embeddings"] == shape["tie_word_embeddings"]
    assert written["query_pre_attn_scalar"] == 20 and written["sliding_window"] == 6
    assert written["layer_types"] == again.config.layer_types and "hidden_act" not in written
    assert written["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4


def test_fp8_rollout_is_refused_for_gemma3(tmp_path):
    """fp8 rollout folds each block's input norm weight into its projections: a norm by 1 + weight, and one on each
    branch's output, is not that; the engine refuses it."""
    from rollout.model import EngineModel
    from rollout.parallel import TPGroup

    with pytest.raises(ValueError, match="fp8 rollout is not supported for model_type gemma3_text"):
        EngineModel(ModelArgs(model_type="gemma3_text"), TPGroup(), torch.float32, torch.device("cpu"), 64,
                    quantization="fp8")


def test_lora_all_linear_saves_as_peft_and_peft_loads_it_with_our_logits(tmp_path):
    """all-linear (verl's default) on a Gemma 3 adapts q_proj .. down_proj (not its norms); save_peft_adapter writes
    peft's adapter, which PeftModel.from_pretrained on Gemma3ForCausalLM reads with meshppo's logits, and which reads
    back into the same adapters; exclude_modules may name its pre_feedforward_layernorm (a module of
    Gemma3ForCausalLM)."""
    from models.lora import LoRAConfig, model_targets

    hf, path = _saved(tmp_path)
    ours = check_peft_adapter_round_trip(
        tmp_path, hf, path, "gemma3_text", VOCAB, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                    "v_proj"],
        adapted=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"))
    assert model_targets(LoRAConfig(4, 8.0, exclude_modules=["pre_feedforward_layernorm"]), ours.args)


def test_a_gemma3_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """A Gemma3TextForSequenceClassification directory (num_labels 1, a reward model's form) loads as meshppo's value
    model: its score at a sequence's last token is transformers' logit."""
    cfg = transformers.Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_labels=1,
                                        pad_token_id=0, sliding_window=6, layer_types=LAYERS, rope_parameters=ROPE,
                                        query_pre_attn_scalar=20)
    hf = hf_causal_lm(lambda **kw: cfg, transformers.Gemma3TextForSequenceClassification)
    check_reward_model_score(tmp_path, hf, VOCAB)


def test_an_image_text_checkpoint_is_refused_saying_how_to_write_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration directory (gemma-3-4b and up; config.json's text_config) is refused naming its
    model_type, not as a config without sizes; the recipe the message gives writes its language model as a
    Gemma3ForCausalLM that meshppo loads, with the image-text model's logits on text."""
    from models.checkpoint import CheckpointFileError, load_model_args

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, sliding_window=6, layer_types=LAYERS, rope_parameters=ROPE,
                query_pre_attn_scalar=20)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    cfg.text_config._attn_implementation = "sdpa"
    transformers.Gemma3ForConditionalGeneration(cfg).save_pretrained(tmp_path / "mm")
    with pytest.raises(CheckpointFileError, match="model_type 'gemma3'.*Gemma3ForConditionalGeneration.*"
                                                  r"lm\.save_pretrained\(out\)"):
        load_model_args(tmp_path / "mm")
    m = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float64).eval()
    lm = transformers.Gemma3ForCausalLM(m.config.text_config)
    lm.model.load_state_dict(m.model.language_model.state_dict())
    lm.save_pretrained(tmp_path / "lm")
    ours = Transformer.from_pretrained(tmp_path / "lm", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = m(input_ids=ids).logits
        assert ref.abs().max() > 1e-2
        assert (ours(ids) - ref).abs().max().item() <= TOL


def test_bf16_logits_round_as_transformers_bf16_ones(tmp_path):
    """In bf16 meshppo's logits are transformers' bf16 ones (on CPU, the same roundings: bit for bit here): the
    embedding scale sqrt(72) rounded to bf16 (8.5) as transformers rounds it, each norm by 1 + weight in float32
    rounded once. The bound, a tenth of transformers' own bf16 error against float64, fails an unrounded scale
    (0.064 on average, beyond that error, 0.058)."""
    _, path = _saved(tmp_path, dtype=torch.float32, hidden_size=72)
    hf64, hf16 = (transformers.Gemma3ForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
                  for dtype in (torch.float64, torch.bfloat16))
    ours = Transformer.from_pretrained(path, dtype=torch.bfloat16)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        truth, theirs, got = hf64(input_ids=ids).logits, hf16(input_ids=ids).logits.double(), ours(ids).double()
    bf16_error = (theirs - truth).abs().mean().item()
    assert bf16_error > 1e-2
    assert (got - theirs).abs().mean().item() <= 0.1 * bf16_error


def test_override_config_sets_the_full_attention_layers_rope_and_the_sliding_layers_window(tmp_path):
    """verl's model.override_config on a Gemma 3: rope_theta is its full_attention layers' (rope_parameters'
    full_attention), the sliding_attention layers keep rope_local_base_freq; sliding_window sets their window, null
    is refused naming the override."""
    from models.checkpoint import CheckpointFileError, load_model_args

    _, path = _saved(tmp_path, dtype=torch.float32)
    args = load_model_args(path, {"rope_theta": 5e5, "sliding_window": 9})
    assert (args.rope_theta, args.local_rope_args().rope_theta, args.layer_windows) == (5e5, 1e4, [9, None, 9])
    assert args.to_hf_config().rope_parameters["full_attention"]["rope_theta"] == 5e5
    with pytest.raises(CheckpointFileError, match="model.override_config's"):
        load_model_args(path, {"sliding_window": None})
