"""Mistral checkpoints (`model_type: mistral`, `MistralForCausalLM`) against transformers' implementation on tiny
random weights, in float64 on CPU: meshppo's model, its engine, the trainer's loading path, the export, and its
sliding window (read, and bounding the run's lengths)."""

import json

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths

transformers = pytest.importorskip("transformers")

VOCAB = 97
# float64: rounding is ~1e-15 of the logits (~1); a wrong architecture (a window, a head size, a bias) is off by > 1e-3
TOL = 1e-9
# Explicit head_dim (24 against hidden / heads 16, as Mistral-Nemo's 128 against 160) with GQA (4 query heads on 2 KV
# heads); and head_dim from hidden / heads with one KV head.
SHAPES = [dict(num_key_value_heads=2, head_dim=24), dict(num_key_value_heads=1)]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _mistral(dtype=torch.float64, **overrides):
    """transformers' MistralForCausalLM, random weights large enough that the logits are decisive."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, sliding_window=None, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    cfg = transformers.MistralConfig(**kw)
    cfg._attn_implementation = "sdpa"  # eager attention takes its softmax in float32
    model = transformers.MistralForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in name
                    else 0.15 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


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
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    mask[1, :15] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        got = ours(ids, position_ids=pos, attention_mask=mask)
        real = mask.bool()
        assert ref[real].abs().max() > 1  # decisive logits: the tolerance is far below their differences
        assert (got[real] - ref[real]).abs().max().item() <= TOL
        lengths = [5, 17, 1, 30]
        seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
        cu = cu_seqlens_from_lengths(lengths)
        packed = ours(torch.cat(seqs)[None], cu_seqlens=cu)[0]
        for i, s in enumerate(seqs):
            assert (packed[cu[i]:cu[i + 1]] - hf(input_ids=s[None]).logits[0]).abs().max().item() <= TOL


def test_engine_greedy_tokens_and_log_probs_are_the_models(tmp_path):
    """The engine on a Mistral checkpoint (GQA, explicit head_dim; chunked prefill and preemption forced):
    greedy tokens are those of a no-cache loop over the training model, and its log-probs are the
    training forward's (to float32, which the engine returns them in); transformers' logits pick the same
    tokens."""
    from rollout import SamplingParams
    from tests.unit.test_engine import check_against_training_forward, greedy_reference, make_engine

    hf, path = _saved(tmp_path, **SHAPES[0])
    model = Transformer.from_pretrained(path, dtype=torch.float64).eval()
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (1, 7, 13, 29, 4)]
    engine = make_engine(model, dtype=torch.float64, num_kv_blocks=16, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert engine.last_stats["preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(model, prompt, 10)
        check_against_training_forward(model, out, params, atol=1e-5)  # the engine returns float32 log-probs
        with torch.no_grad():
            hf_logits = hf(input_ids=torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
        assert hf_logits.argmax(-1).tolist() == out.token_ids


def _load_through_the_trainer(rank, world, path):
    from trainer.setup import build_trained_model
    from sharding import ParallelDims
    from tests.unit.test_bad_model_files import _cfg

    cfg = _cfg(f"actor_rollout_ref.model.path={path}", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
               "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32")
    mesh = ParallelDims(world).build_meshes("cpu").train
    model = build_trained_model(cfg, "actor", mesh, torch.device("cpu"))
    assert model.args.model_type == "mistral" and model.args.head_dim == 24
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    expected = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    assert got.keys() == expected.keys()
    for k in got:  # every tensor as saved, bit for bit
        assert torch.equal(got[k], expected[k]), k


def test_a_saved_mistral_directory_loads_through_the_trainers_model_path(tmp_path):
    """config.json + model.safetensors as transformers' save_pretrained writes them (float32), read by
    the trainer's actor builder (FSDP, one gloo rank): every weight lands where transformers put it."""
    from tests.dist_utils import run_distributed

    _, path = _saved(tmp_path, dtype=torch.float32, **SHAPES[0])
    assert json.loads((path / "config.json").read_text())["model_type"] == "mistral"
    run_distributed(_load_through_the_trainer, 1, str(path))


def test_a_sliding_window_shorter_than_the_context_loads_and_bounds_the_run(tmp_path):
    """Mistral-7B-v0.1's sliding_window 4096 under max_position_embeddings 32768: transformers windows every
    layer, meshppo's attention reads the whole context, which is the same for sequences within the window. The
    checkpoint loads (it was refused at load); a run is refused only where its sequences reach past the window
    (`ModelArgs.window_exceeded`, the trainer's pre-flight and rollout.generate: tests/unit/test_attention_window.py).
    A window at or past max_position_embeddings, or null, bounds nothing the model is meant for."""
    _, path = _saved(tmp_path, sliding_window=64, max_position_embeddings=256)
    args = Transformer.from_pretrained(path).args
    assert args.sliding_window == args.attention_window == 64
    assert args.window_exceeded(64) is None
    assert args.window_exceeded(65).startswith("config.json's sliding_window=64 (every layer of transformers' "
                                               "Mistral attends through it): ")
    cfg = dict(model_type="mistral", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    assert ModelArgs.from_hf_config(dict(cfg, sliding_window=256)).window_exceeded(256) is None
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
    from models.checkpoint import load_model_args
    from trainer.checkpointing import export_hf

    _, base = _saved(tmp_path, dtype=torch.float32, sliding_window=window, **SHAPES[0])
    ours = Transformer.from_pretrained(base)

    class _Tokenizer:
        def save_pretrained(self, path):
            pass

    out = tmp_path / "hf_actor"
    export_hf(ours, load_model_args(base), _Tokenizer(), str(out), True, base_model=str(base))
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "mistral" and written["architectures"] == ["MistralForCausalLM"]
    assert written["sliding_window"] == window and written["head_dim"] == 24
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(again).__name__ == "MistralForCausalLM" and again.config.sliding_window == window
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (again.double()(input_ids=ids).logits - ours.double()(ids)).abs().max().item() <= TOL

    critic = Transformer.from_pretrained(base, head="value")
    with torch.no_grad():
        critic.score.weight.normal_(0, 0.5)
    critic.save_pretrained(tmp_path / "v")
    scorer = transformers.AutoModelForTokenClassification.from_pretrained(tmp_path / "v").eval()
    assert type(scorer).__name__ == "MistralForTokenClassification"
    with torch.no_grad():
        assert (scorer.double()(input_ids=ids).logits[..., 0] - critic.double()(ids)).abs().max().item() <= TOL
