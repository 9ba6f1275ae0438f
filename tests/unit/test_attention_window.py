"""Sliding-window attention (Mistral's and Phi3's `sliding_window`, Qwen2's `use_sliding_window` layers): each
windowed layer attends to the last `sliding_window` positions, in the trainer's model (padded, packed, prefix
sharing, on every path of `models.attention`) and in the engine (`rollout.attention`, the Triton kernels:
tests/unit/test_triton_kernels.py), so that logits and log-probs past the window are transformers'. Runs past the
window are accepted; `override_config.sliding_window` sets the window (null: none), as verl sets it on the
Hugging Face config. References: transformers' windowed models in float64; each check fails where every layer
reads the whole context."""

import json

import pytest
import torch

from models import ModelArgs, Transformer, cu_seqlens_from_lengths
from models.args import apply_overrides
from tests.unit.hf_family import TOL, check_engine_greedy, check_padded_and_packed_logits, hf_causal_lm, one_thread

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


def _qwen2(tmp_path, window=32, max_window_layers=1, **config):
    """A saved Qwen2ForCausalLM whose layers from `max_window_layers` on (or those `layer_types` names) attend
    through `window`."""
    hf = hf_causal_lm(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, use_sliding_window=True, sliding_window=window,
                      max_window_layers=max_window_layers, tie_word_embeddings=False, **config)
    hf.save_pretrained(tmp_path / "qwen2")
    return hf, tmp_path / "qwen2"


def _max_diff(ours, hf, n, seed=1):
    ids = torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ours(ids) - hf(input_ids=ids).logits).abs().max().item()


def _phi3(tmp_path, window=8):
    """A saved Phi3ForCausalLM whose every layer attends through `window` (Phi-3-mini-4k's 2047 of 4096)."""
    hf = hf_causal_lm(transformers.Phi3Config, transformers.Phi3ForCausalLM, vocab_size=VOCAB, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, sliding_window=window, tie_word_embeddings=False,
                      pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf.save_pretrained(tmp_path / "phi3")
    return hf, tmp_path / "phi3"


def _qwen2_layer_types(tmp_path, window=8):
    """A saved Qwen2ForCausalLM with layer_types: layers 0 and 2 of 3 windowed by `window`, layer 1 full."""
    return _qwen2(tmp_path, window, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _unwindowed(model):
    """`model` with every layer reading the whole context (what meshppo's attention did before windows)."""
    for layer in model.layers:
        layer.self_attn.window = None
    return model


def test_mistral_window_logits_are_transformers_past_the_window(tmp_path):
    """A Mistral with sliding_window 64 below max_position_embeddings 256: its logits equal transformers' windowed
    model within the window and past it (150 tokens, more than twice the window); attending to the whole context
    gives them within the window only, so the window is what makes them equal past it."""
    hf, path = _mistral(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.attention_window == WINDOW and ours.args.windowed_layers == [0, 1]
    assert [layer.self_attn.window for layer in ours.layers] == [WINDOW, WINDOW]
    for n in (48, WINDOW, WINDOW + 1, 150):
        assert _max_diff(ours, hf, n) <= TOL, n
    assert _max_diff(_unwindowed(ours), hf, WINDOW) <= TOL and _max_diff(ours, hf, WINDOW + 1) > 1e-3


def test_qwen2_windowed_layers_logits_are_transformers_past_the_window(tmp_path):
    """Qwen2 with use_sliding_window and max_window_layers 1 of 3 layers (layers 1 and 2 windowed by 32, layer 0
    full): its logits are transformers' (sdpa, float64) at 20, 32, 33 and 100 tokens; with every layer full
    they differ at 33, with every layer windowed too (layer 0 is full in transformers)."""
    hf, path = _qwen2(tmp_path)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert ours.args.windowed_layers == [1, 2] and ours.args.attention_window == 32
    assert ours.args.layer_windows == [None, 32, 32]
    for n in (20, 32, 33, 100):
        assert _max_diff(ours, hf, n) <= TOL, n
    ours.layers[0].self_attn.window = 32  # windowing the full layer too: right within the window only
    assert _max_diff(ours, hf, 32) <= TOL and _max_diff(ours, hf, 33) > 1e-3
    assert _max_diff(_unwindowed(ours), hf, 32) <= TOL and _max_diff(ours, hf, 33) > 1e-3
    # the same keys read from a config.json before transformers v5 (no layer_types)
    cfg = dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=32)
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=1)).layer_windows == [None, 32, 32]
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=3)).layer_windows == [None, None, None]
    assert ModelArgs.from_hf_config(dict(cfg, max_window_layers=1, use_sliding_window=False)).attention_window is None
    with pytest.raises(ValueError, match="layer_types=.*meshppo supports"):
        ModelArgs.from_hf_config(dict(cfg, layer_types=["full_attention", "chunked_attention", "full_attention"]))


@pytest.mark.parametrize("make", [_mistral, _phi3, _qwen2_layer_types], ids=["mistral", "phi3", "qwen2"])
def test_padded_and_packed_logits_past_a_window_of_8(tmp_path, make):
    """Windows of 8 under 40-token rows (left-padded, with positions from the mask) and packed sequences of up to
    30 tokens: meshppo's logits are transformers' (Mistral, Phi3, Qwen2 with layer_types windowing layers 0 and 2
    of 3); attending to the whole context fails the same check."""
    hf, path = make(tmp_path, window=8)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    assert 8 in ours.args.layer_windows
    check_padded_and_packed_logits(hf, ours, VOCAB)
    with pytest.raises(AssertionError):
        check_padded_and_packed_logits(hf, _unwindowed(ours), VOCAB)


@pytest.mark.parametrize("make", [_mistral, _qwen2_layer_types], ids=["mistral", "qwen2"])
def test_shared_prefix_responses_window_back_into_their_prompt(tmp_path, make):
    """Prefix sharing (one copy of a prompt, its responses after it): a response token's window of 8 reaches back
    into its 12-token prompt; the responses' log-probs are transformers' over each prompt + response, and those of
    the plain packed layout (float64 up to the LM head's float32 log-probs)."""
    from trainer.forward import build_micro_batch, response_logprobs

    hf, path = make(tmp_path, window=8)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    g = torch.Generator().manual_seed(5)
    tok = lambda n: torch.randint(1, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    a, b = tok(12), tok(5)
    prompts, responses = [a, b, a, a], [tok(15), tok(3), tok(6), tok(20)]
    width = max(map(len, responses))
    got = {}
    for share in (False, True):
        mb = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=share)
        assert (mb.shared is not None) == share
        with torch.no_grad():
            got[share] = response_logprobs(ours, mb, width, temperature=1.0, with_entropy=False)[0]
    for i, (p, r) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(r)[:, None])[:, 0]
        for share in (False, True):
            # the LM head's log-probs are float32 (~1e-7 off); a window's effect is > 1e-3
            assert (got[share][i, :len(r)] - ref).abs().max().item() <= 1e-5, (i, share)
    mb = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=True)
    with torch.no_grad():
        full = response_logprobs(_unwindowed(ours), mb, width, temperature=1.0, with_entropy=False)[0]
    assert (full[3, :20] - got[True][3, :20]).abs().max() > 1e-3


def test_packed_gradients_equal_the_padded_layout_with_windows(tmp_path):
    """The gradients of a weighted sum of the logits through windowed layers (Qwen2's layers 0 and 2 by a window of
    8, layer 1 full): the packed layout's (segment by segment and the block-diagonal mask over the row) equal the
    padded layout's, in float64, and the logits are transformers'."""
    import models.attention as attention

    hf, path = _qwen2_layer_types(tmp_path, window=8)
    lengths = [23, 9, 17]
    seqs = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]

    def grads(fn):
        model = Transformer.from_pretrained(path, dtype=torch.float64)
        logits = fn(model)
        w = torch.sin(torch.arange(logits.numel(), dtype=torch.float64).reshape(logits.shape))
        (logits * w).sum().backward()
        return logits.detach(), {n: p.grad for n, p in model.named_parameters()}

    def padded(model):
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, :len(s)], mask[i, :len(s)] = s, 1
        out = model(ids, attention_mask=mask)
        return torch.cat([out[i, :n] for i, n in enumerate(lengths)])

    def packed(model):
        return model(torch.cat(seqs)[None], cu_seqlens=cu_seqlens_from_lengths(lengths), max_seqlen=max(lengths))[0]

    ref, ref_grads = grads(padded)
    with torch.no_grad():
        assert (ref - torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])).abs().max().item() <= TOL
    by_segment = grads(packed)
    real = attention._segment_layouts
    attention._segment_layouts = lambda *a: None  # the block-diagonal mask over the whole row
    try:
        by_mask = grads(packed)
    finally:
        attention._segment_layouts = real
    for out, gr in (by_segment, by_mask):
        assert (out - ref).abs().max().item() <= TOL
        for n, gref in ref_grads.items():
            assert (gr[n] - gref).abs().max().item() <= 1e-9 * max(1.0, gref.abs().max().item()), n


@pytest.mark.parametrize("make", [_mistral, _qwen2_layer_types], ids=["mistral", "qwen2"])
def test_engine_greedy_past_the_window(tmp_path, make):
    """The engine (PyTorch path, float64; chunked prefill of 16 tokens a step and preemption) with windows of 8 under
    prompts of up to 29 tokens and 10 new ones: its greedy tokens are a no-cache loop's over the training model,
    its log-probs the training forward's, and transformers' windowed logits pick the same tokens. The same engine
    reading the whole context gives other log-probs."""
    from rollout import SamplingParams

    hf, path = make(tmp_path, window=8)
    engine, prompts, params, outs = check_engine_greedy(hf, path, VOCAB)
    assert 8 in engine.model.windows
    engine.model.windows = [None] * len(engine.model.windows)
    full = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=0))
    windowed = Transformer.from_pretrained(path, dtype=torch.float64).eval()
    worst = 0.0
    for out in full:  # the engine's log-probs against the windowed training forward's
        p = len(out.prompt_token_ids)
        with torch.no_grad():
            logits = windowed(torch.tensor([out.prompt_token_ids + out.token_ids]))[0, p - 1:-1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(out.logprobs, dtype=torch.float64) - ref).abs().max().item())
    assert worst > 1e-3


def test_kept_kv_turns_continue_past_the_window(tmp_path):
    """Multi-turn with kept K/V (`generate(keep_kv=True)`): turn 2 prefills only its appended tokens over the kept
    cache, past a window of 8 (turn 2 starts at 14 tokens or more); its tokens and log-probs are a recompute's, and every
    log-prob is the windowed training forward's (transformers' logits: the tests above)."""
    import dataclasses

    from rollout import SamplingParams
    from tests.unit.test_engine import check_against_training_forward, make_engine

    _, path = _mistral(tmp_path, window=8)
    model = Transformer.from_pretrained(path, dtype=torch.float64).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (6, 11)]
    turn = SamplingParams(n=1, temperature=1.0, max_tokens=99, seed=4, ignore_eos=True)
    keys = [(i, k) for i in range(2) for k in range(2)]
    results = []
    for keep in (False, True):
        engine = make_engine(model, dtype=torch.float64, max_num_batched_tokens=16)
        first = engine.generate(prompts, dataclasses.replace(turn, n=2), max_tokens=[5, 7], keep_kv=keep)
        second_in = [prompts[i] + o.token_ids + [7, 8, 9] for (i, _), o in zip(keys, first)]
        second = engine.generate(second_in, turn, sample_keys=keys, max_tokens=[9] * 4)
        assert (engine.last_stats["reused_kv_tokens"] > 0) == keep
        results.append(first + second)
    for a, b in zip(*results):
        assert a.token_ids == b.token_ids
        check_against_training_forward(model, b, turn, atol=1e-5)
    assert min(len(o.prompt_token_ids) for o in results[1][4:]) > 8  # turn 2 starts past the window


def _cfg(path, prompt, response, *extra):
    from tests.unit.test_bad_model_files import _cfg

    return _cfg(f"actor_rollout_ref.model.path={path}", f"data.max_prompt_length={prompt}",
                f"data.max_response_length={response}", *extra)


def test_preflight_accepts_runs_past_the_window(tmp_path):
    """The trainer's pre-flight accepts runs whose sequences reach past a window (it refused them while meshppo's
    attention read the whole context): Mistral's 64 under prompt 16 + response 64 = 80 and 16 + 200, Qwen2's
    windowed layers (32) under 16 + 17, and a critic and a reward model of the windowed model."""
    from trainer.setup import preflight

    _, path = _mistral(tmp_path)
    preflight(_cfg(path, 16, 64), devices=False)
    preflight(_cfg(path, 16, 200), devices=False)
    preflight(_cfg(path, 16, 64, "algorithm.adv_estimator=gae", f"critic.model.path={path}", "reward_model.enable=true",
                   f"reward_model.model.path={path}", "reward_model.model.input_tokenizer=null"), devices=False)
    _, qwen = _qwen2(tmp_path)
    preflight(_cfg(qwen, 16, 17), devices=False)


def test_override_config_sliding_window_sets_the_window(tmp_path):
    """override_config.sliding_window, set on the config before the model is built as in verl: null attends to the
    whole context, a number is the window of the layers config.json windows; it is kept out of the checkpoint's
    fingerprint (the trainer's: the fields without extra_hf: it changes no weight). A bad value or a model without
    a window is refused naming the key."""
    from trainer.configlib import ConfigError

    hf, path = _mistral(tmp_path)
    key = "actor_rollout_ref.model.override_config"
    with pytest.raises(ConfigError, match=f"{key}.sliding_window: expected an integer > 0, got 0"):
        _cfg(path, 16, 64, f"{key}.sliding_window=0")

    from models.checkpoint import load_model_args

    args = load_model_args(path)
    unwindowed = load_model_args(path, {"sliding_window": None})
    assert unwindowed.attention_window is None and apply_overrides(args, {"sliding_window": None}) == unwindowed
    assert unwindowed.layer_windows == [None, None] and load_model_args(path, {"sliding_window": 8}).layer_windows == [8, 8]
    assert args.fingerprint == unwindowed.fingerprint
    # the model built from the overridden arguments attends through the override: transformers' model of it
    ours = Transformer(load_model_args(path, {"sliding_window": 8})).to(torch.float64)
    ours.load_state_dict(Transformer.from_pretrained(path, dtype=torch.float64).state_dict())
    hf.config.sliding_window = 8
    assert _max_diff(ours, hf, 40) <= TOL
    hf.config.sliding_window = WINDOW

    llama = tmp_path / "llama"
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(llama)
    with pytest.raises(ValueError, match="override_config.sliding_window=8: model_type llama has no sliding window"):
        load_model_args(llama, {"sliding_window": 8})


@pytest.mark.parametrize("make", [_mistral, _qwen2])
def test_export_keeps_the_window(tmp_path, make):
    """`save_pretrained` (the export's writer) copies the window's keys through: transformers reloads the same
    windowed layers, with meshppo's logits within and past the window."""
    hf, path = make(tmp_path)
    ours = Transformer.from_pretrained(path, dtype=torch.float64)
    ours.save_pretrained(tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["sliding_window"] == hf.config.sliding_window
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert again.config.layer_types == hf.config.layer_types if hasattr(hf.config, "layer_types") else True
    assert _max_diff(ours, again, ours.args.attention_window) <= TOL
    assert _max_diff(ours, again, 150) <= TOL


def test_rollout_generate_past_the_window(tmp_path):
    """`python -m rollout.generate` generates past the window (it refused a prompt + --max-new-tokens past it): a
    40-token prompt and 100 greedy tokens under Mistral's window of 64."""
    from rollout.generate import main

    _, path = _mistral(tmp_path)
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": list(range(3, 43))}) + "\n")  # 40 tokens
    out = tmp_path / "out.jsonl"
    assert main(["--model", str(path), "--prompts", str(prompts), "--out", str(out), "--temperature", "0",
                 "--ignore-eos", "--max-new-tokens", "100"]) == 0
    assert len(json.loads(out.read_text())["token_ids"]) == 100
