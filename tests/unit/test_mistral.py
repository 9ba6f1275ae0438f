"""Mistral checkpoints (`model_type: mistral`, `MistralForCausalLM`) against transformers' implementation on tiny
random weights, in float64 on CPU: meshppo's model, its engine, the trainer's loading path, the export, and its
sliding window (every layer attends through it)."""

import json

import pytest
import torch

from models import ModelArgs, Transformer
from tests.unit.hf_family import (TOL, check_engine_greedy, check_export_round_trip, check_padded_and_packed_logits,
                                  hf_causal_lm, one_thread, trainer_loads_bit_for_bit, unprefixed)

transformers = pytest.importorskip("transformers")

_one_thread = one_thread
VOCAB = 97
# Explicit head_dim (24 against hidden / heads 16, as Mistral-Nemo's 128 against 160) with GQA (4 query heads on 2 KV
# heads); and head_dim from hidden / heads with one KV head.
SHAPES = [dict(num_key_value_heads=2, head_dim=24), dict(num_key_value_heads=1)]


def _mistral(dtype=torch.float64, **overrides):
    """transformers' MistralForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, sliding_window=None, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, bos_token_id=1, eos_token_id=2)
    return hf_causal_lm(transformers.MistralConfig, transformers.MistralForCausalLM, dtype, **(kw | overrides))


def _saved(tmp_path, **overrides):
    hf = _mistral(**overrides)
    hf.save_pretrained(tmp_path / "mistral")
    return hf, tmp_path / "mistral"


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_equal_transformers_mistral(tmp_path, shape):
    """Padded batches (left padding, positions from the mask) and packed sequences: meshppo's logits are
    MistralForCausalLM's; its parameter count (the FLOP formula's) is transformers'."""
    hf, path = _saved(tmp_path, **shape)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.model_type == "mistral" and ours.args.head_dim == shape.get("head_dim", 16)
    assert ours.args.rope_theta == 1_000_000.0 and ours.args.attention_window is None
    assert ours.args.num_params() == sum(p.numel() for p in hf.parameters())  # the MFU's FLOP count
    check_padded_and_packed_logits(hf, ours, VOCAB)


def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path):
    """The engine on a Mistral checkpoint (GQA, explicit head_dim; chunked prefill and preemption forced):
    greedy tokens are those of a no-cache loop over the training model, and its log-probs are the
    training forward's (to float32, which the engine returns them in); transformers' logits pick the same
    tokens."""
    hf, path = _saved(tmp_path, **SHAPES[0])
    check_engine_greedy(hf, path, VOCAB)


def test_a_saved_mistral_directory_loads_through_the_trainers_model_path(tmp_path):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by
    the trainer's actor builder (FSDP, one gloo rank): every weight lands where transformers put it."""
    from tests.dist_utils import run_distributed

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    assert json.loads((path / "config.json").read_text())["model_type"] == "mistral"
    run_distributed(trainer_loads_bit_for_bit, 1, str(path), "mistral", 24, unprefixed)


def test_a_sliding_window_shorter_than_the_context_loads_and_windows_every_layer(tmp_path):
    """Mistral-7B-v0.1's sliding_window 4096 under max_position_embeddings 32768: transformers windows every
    layer, and so does meshppo (logits past the window and runs past it: tests/unit/test_attention_window.py).
    A window of any positive size, or null, loads; another value is refused."""
    _, path = _saved(tmp_path, sliding_window=64, max_position_embeddings=256)
    args = Transformer.from_pretrained(path).args
    assert args.sliding_window == args.attention_window == 64 and args.layer_windows == [64, 64]
    cfg = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    assert ModelArgs.from_hf_config(dict(cfg, sliding_window=256)).layer_windows == [256, 256]
    assert ModelArgs.from_hf_config(dict(cfg, sliding_window=4096)).sliding_window == 4096
    assert ModelArgs.from_hf_config(dict(cfg, sliding_window=None)).attention_window is None
    for bad in (0, -1, "64", True):
        with pytest.raises(ValueError, match="is not a positive integer or null"):
            ModelArgs.from_hf_config(dict(cfg, sliding_window=bad))


def test_a_window_reaching_every_position_gives_transformers_logits(tmp_path):
    """sliding_window = max_position_embeddings: transformers' windowed attention over a full-length
    sequence is meshppo's full attention."""
    hf, path = _saved(tmp_path, sliding_window=48, max_position_embeddings=48)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= TOL


def test_biases_are_refused_for_mistral():
    """transformers' Mistral has no biases: a model with them would export as another model."""
    with pytest.raises(ValueError, match="mistral with attention_bias or mlp_bias is not supported"):
        ModelArgs(model_type="mistral", mlp_bias=True)


@pytest.mark.parametrize("window", [None, 256])
def test_export_round_trips_through_transformers_mistral(tmp_path, window):
    """The trained-policy export (`trainer.checkpointing.export_hf`, which `tools.export_hf` runs) writes a
    directory transformers loads as MistralForCausalLM, its sliding_window as read (MistralConfig's default
    is 4096: a window config.json did not have), with meshppo's logits; a Mistral value model exports as
    MistralForTokenClassification."""
    _, base = _saved(tmp_path, dtype=torch.float32, sliding_window=window, **SHAPES[0])
    written, again = check_export_round_trip(tmp_path, base, "Mistral", VOCAB)
    assert written["model_type"] == "mistral" and written["sliding_window"] == window and written["head_dim"] == 24
    assert again.config.sliding_window == window
