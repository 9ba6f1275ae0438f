"""OLMo-2 checkpoints (`model_type: olmo2`, `Olmo2ForCausalLM`) against transformers' implementation on tiny random
weights, in float64 on CPU: meshppo's model (post-norm blocks, q / k norms over the whole projections), its engine,
the trainer's loading path, the export, and what has no transformers class (a value model's export) or no meshppo
counterpart."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (check_engine_greedy, check_export_round_trip, check_hf_critic_refused_at_preflight,
                                  check_padded_and_packed_logits, check_peft_adapter_round_trip,
                                  check_reward_model_score, hf_causal_lm, one_thread, randomized,
                                  trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Explicit head_dim (24 against hidden / heads 16) with GQA (4 query heads on 2 KV heads), untied; and head_dim from
# hidden / heads with one KV head, tied embeddings (OLMo-2-0425-1B ties them); and attention_bias (q, k, v and, in
# transformers' Olmo2, o_proj biased).
SHAPES = [dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
          dict(num_key_value_heads=1, tie_word_embeddings=True),
          dict(num_key_value_heads=2, attention_bias=True, tie_word_embeddings=False)]


def _olmo2(dtype=torch.float64, **overrides):
    """transformers' Olmo2ForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
              rope_parameters={"rope_type": "default", "rope_theta": 500_000.0}, pad_token_id=1, bos_token_id=None,
              eos_token_id=2)
    return hf_causal_lm(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, dtype, **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _olmo2(**overrides)
    hf.save_pretrained(tmp_path / "olmo2")
    return hf, tmp_path / "olmo2"


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_olmo2(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    Olmo2ForCausalLM's (post-norm blocks without an input norm, q / k normed over the whole projections);
    its parameter count (the FLOP formula's) is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.model_type == "olmo2" and ours.args.head_dim == shape.get("head_dim", 16)
    assert ours.args.post_norm and ours.args.full_qk_norm and not ours.args.qk_norm
    assert ours.args.o_proj_bias == shape.get("attention_bias", False)
    assert ours.args.tie_word_embeddings == shape["tie_word_embeddings"]
    assert ours.layers[0].self_attn.q_norm.weight.shape == (4 * ours.args.head_dim,)
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_rope_scaling_is_read_as_transformers_reads_it(tmp_path):
    """An OLMo-2 with llama3 RoPE scaling (the shared rope code): transformers' logits at positions past the
    original context."""
    rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf, path = _saved(tmp_path, rope_parameters=rope)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.rope_type == "llama3"
    check_padded_and_packed_logits(hf, ours, VOCAB)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]])
def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path, shape):
    """The engine on an OLMo-2 checkpoint (GQA, explicit head_dim; with attention_bias; chunked prefill and
    preemption forced): greedy tokens are those of a no-cache loop over the training model, its log-probs the
    training forward's, and transformers' logits pick the same tokens."""
    hf, path = _saved(tmp_path, **shape)
    check_engine_greedy(hf, path, VOCAB)


@pytest.mark.parametrize("world", [1, 2])
def test_a_saved_olmo2_directory_loads_through_the_trainers_model_path(tmp_path, world):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by
    the trainer's actor builder (FSDP on one gloo rank, and sharded over two: the whole-projection q / k norms and
    o_proj's bias too): every weight lands where transformers put it. verl's wrap policy may name
    Olmo2DecoderLayer."""
    from sharding import FSDPConfig
    from tests.dist_utils import run_distributed

    assert FSDPConfig(wrap_policy={"transformer_layer_cls_to_wrap": ["Olmo2DecoderLayer"]})
    _, path = _saved(tmp_path, dtype=torch.float32, head_dim=24, **SHAPES[2])
    assert json.loads((path / "config.json").read_text())["model_type"] == "olmo2"
    run_distributed(trainer_loads_bit_for_bit, world, str(path), "olmo2", 24, unprefixed)


@pytest.mark.parametrize("shape", SHAPES)
def test_export_round_trips_through_transformers_olmo2(tmp_path, shape):
    """The trained-policy export writes a directory transformers loads as Olmo2ForCausalLM with meshppo's
    logits (head_dim written where it is not hidden / heads: Olmo2Config has no such field, its attention reads
    it); a value model's export is refused, transformers having no Olmo2ForTokenClassification."""
    _, base = _saved(tmp_path, dtype=torch.float32, **shape)
    written, again = check_export_round_trip(tmp_path, base, "Olmo2", VOCAB, token_classifier=False)
    assert written["model_type"] == "olmo2" and written["tie_word_embeddings"] == shape["tie_word_embeddings"]
    assert written.get("head_dim") == shape.get("head_dim")
    assert written["attention_bias"] == shape.get("attention_bias", False)
    if written["attention_bias"]:
        assert again.model.layers[0].self_attn.o_proj.bias.abs().max() > 0


def test_an_mlp_bias_is_refused_for_olmo2():
    """transformers' Olmo2 has no MLP biases (its config no mlp_bias): a model with them would export as another."""
    with pytest.raises(ValueError, match="olmo2 with mlp_bias is not supported"):
        ModelArgs(model_type="olmo2", mlp_bias=True)


def test_a_critic_written_as_a_hugging_face_directory_is_refused_at_the_pre_flight(tmp_path):
    """An OLMo-2 critic trains and its meshppo checkpoint keeps it; critic.checkpoint.save_contents with hf_model
    (a Hugging Face directory of the value model, which no transformers class reads back) is refused before the
    run, naming the key."""
    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    check_hf_critic_refused_at_preflight(path, r"an olmo2 value model cannot be written .*no "
                                               r"Olmo2ForTokenClassification")


def test_lora_all_linear_saves_as_peft_and_peft_loads_it_with_our_logits(tmp_path):
    """all-linear (verl's default) on an OLMo-2 adapts q_proj .. down_proj (its q_norm / k_norm are norms, not
    linear modules); save_peft_adapter writes peft's adapter, which PeftModel.from_pretrained on Olmo2ForCausalLM
    reads with meshppo's logits, and which reads back (lora_adapter_path) into the same adapters."""
    hf, path = _saved(tmp_path, **SHAPES[0])
    check_peft_adapter_round_trip(tmp_path, hf, path, "olmo2", VOCAB,
                                  ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
                                  adapted=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def test_an_olmo2_sequence_classifier_loads_as_a_reward_model(tmp_path):
    """An Olmo2ForSequenceClassification directory (num_labels 1, the form of OLMo-2's reward models) loads as
    meshppo's value model: its score at a sequence's last token is transformers' logit."""
    cfg = transformers.Olmo2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=1,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    cfg._attn_implementation = "sdpa"
    hf = randomized(transformers.Olmo2ForSequenceClassification(cfg))
    check_reward_model_score(tmp_path, hf, VOCAB)


def test_lora_selections_are_made_on_olmo2s_module_names():
    """peft selects on Olmo2ForCausalLM's module names, whose layers have no input_layernorm: exclude_modules
    naming it names no module of an OLMo-2 and is refused (peft would pass over it), as on any type an entry
    naming no module is; it was taken as a Llama's norm and passed over."""
    from models.lora import LoRAConfig, model_targets

    args = ModelArgs(model_type="olmo2", num_hidden_layers=2)
    assert model_targets(LoRAConfig(4, 8.0), args) == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj")
    cfg = LoRAConfig(4, 8.0, exclude_modules=["input_layernorm"])
    assert model_targets(cfg, ModelArgs(model_type="llama", num_hidden_layers=2))  # a Llama's norm: nothing taken out
    with pytest.raises(ValueError, match=r"exclude_modules has \['input_layernorm'\], which names no module"):
        model_targets(cfg, args)


def test_fp8_rollout_is_refused_for_olmo2(tmp_path):
    """fp8 rollout folds each block's input norm into its projections, and an OLMo-2's post-norm blocks have none:
    actor_rollout_ref.rollout.quantization=fp8 is refused at the trainer's pre-flight naming the key, and the
    engine refuses it too."""
    from rollout.model import EngineModel
    from rollout.parallel import TPGroup
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.quantization=fp8: fp8 rollout is not "
                                          r"supported for model_type olmo2"):
        preflight(_cfg(path, 16, 32, "actor_rollout_ref.rollout.quantization=fp8"), devices=False)
    with pytest.raises(ValueError, match="fp8 rollout is not supported for model_type olmo2"):
        EngineModel(Transformer.from_pretrained(path).args, TPGroup(), torch.float32, torch.device("cpu"), 64,
                    quantization="fp8")
