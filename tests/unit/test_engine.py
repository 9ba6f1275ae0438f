"""The engine on CPU (float32) against the training model `models.Transformer`.

Anchors (docs/ARCHITECTURE.md): greedy output equals a plain no-cache forward loop token for token,
with chunked prefill and preemption forced; sampled tokens are exactly the exponential race
over the training forward's logits with the engine's counter-based noise; the returned
log-probs equal log_softmax(logits / T) of the training forward on the generated sequence.
"""

import dataclasses
import json

import pytest
import torch

from models import ModelArgs, Transformer, tp_shard_dim
from rollout import Continuation, EngineConfig, LLMEngine, ParamSlot, RequestOutput, SamplingParams
from rollout.config import check_tp_divisibility
from rollout.sampler import combine_partials, race_group, sample_partials_ref, truncation_threshold
from rollout.sequence import sequence_key
from tests.unit.hf_family import one_thread

VOCAB = 96
_one_thread = one_thread  # tiny ops: intra-op threads only add synchronisation (and stall on a busy machine)


def tiny_args(kind: str, **kw) -> ModelArgs:
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    if kind == "qwen2":
        common.update(model_type="qwen2", attention_bias=True, tie_word_embeddings=True)
    elif kind == "qwen3":  # per-head q/k norms; heads wider than hidden / heads, as Qwen3's are
        common.update(model_type="qwen3", head_dim=24, tie_word_embeddings=True)
    elif kind == "gemma3_text":  # norms by 1 + weight, GeGLU, a sliding layer (window 8, its own RoPE) and a full one
        common.update(model_type="gemma3_text", head_dim=24, tie_word_embeddings=True,
                      extra_hf={"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                "query_pre_attn_scalar": 24})
    elif kind == "gemma2":  # Gemma 3's blocks without q / k norms, one RoPE, soft caps small enough to bite
        common.update(model_type="gemma2", head_dim=24, tie_word_embeddings=True, attn_logit_softcapping=2.0,
                      final_logit_softcapping=3.0,
                      extra_hf={"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
                                "query_pre_attn_scalar": 24})
    elif kind == "qwen3_moe":  # a sparse layer (4 experts of 32, each token through 2, renormalised) and a dense one
        common.update(model_type="qwen3_moe", head_dim=24, tie_word_embeddings=False, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,), norm_topk_prob=True)
    else:
        common.update(model_type="llama", mlp_bias=True, tie_word_embeddings=False, eos_token_id=3)
    common.update(kw)
    return ModelArgs(**common)


def tiny_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """Random weights large enough that the logits are decisive (no near-ties for argmax to flip on)."""
    model = Transformer.build(args, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))
    return model.eval()


def make_engine(model: Transformer, device="cpu", **cfg) -> LLMEngine:
    config = EngineConfig(**{"dtype": torch.float32, "block_size": 4, "num_kv_blocks": 256, **cfg})
    engine = LLMEngine(model.args, config, device=device)
    engine.load_weights(model.named_parameters())
    return engine


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy_reference(model, prompt, max_new):
    """The plain no-cache loop: the whole sequence through the training forward for every token."""
    device = next(model.parameters()).device
    ids = list(prompt)
    for _ in range(max_new):
        ids.append(int(model(torch.tensor([ids], device=device))[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def check_against_training_forward(model, out: RequestOutput, params: SamplingParams, atol: float = 5e-5):
    """Teacher-forced: every token is the race winner over the training logits; log-probs agree."""
    p = len(out.prompt_token_ids)
    seq = torch.tensor([out.prompt_token_ids + out.token_ids], device=next(model.parameters()).device)
    logits = model(seq)[0, p - 1:-1].float().cpu()  # [n_new, V]: logits that produced each new token
    temp = params.temperature if params.temperature > 0 else 1.0
    s = logits / temp
    tokens = torch.tensor(out.token_ids)
    ref_lp = torch.log_softmax(s, -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(out.logprobs), ref_lp, atol=atol, rtol=0)
    if params.temperature == 0:
        assert torch.equal(s.argmax(-1), tokens)
        return
    n_new = len(out.token_ids)
    key = sequence_key(params.seed, out.prompt_index, out.sample_index)
    thresh = truncation_threshold(s, params.top_k, params.top_p) if params.needs_truncation else None
    parts = sample_partials_ref(s, torch.full((n_new,), key), torch.arange(p, p + n_new), torch.tensor(1.0),
                                torch.tensor(1.0), thresh, 0, race_group(s.shape[1]))
    assert torch.equal(combine_partials(parts)[0], tokens)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_greedy_equals_no_cache_loop_with_chunking_and_preemption(kind):
    model = tiny_model(tiny_args(kind, eos_token_id=None))
    prompts = prompts_of([1, 7, 13, 29, 4, 22, 16])
    max_new = 14
    # 16-token chunks split the long prompts; 18 blocks of 4 cannot hold all 7 sequences.
    engine = make_engine(model, num_kv_blocks=18, max_num_batched_tokens=16)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_new))
    stats = engine.last_stats
    assert stats["preemptions"] > 0
    assert stats["prefill_steps"] >= 8
    assert stats["prefill_steps_decoding"] > 0  # decoding rows rode along with prompt chunks
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(model, prompt, max_new)
        assert out.finish_reason == "length" and len(out.logprobs) == max_new
        check_against_training_forward(model, out, SamplingParams(temperature=0))


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0.8, max_tokens=12, seed=5),
    SamplingParams(n=2, temperature=1.3, top_k=7, top_p=0.8, max_tokens=12, seed=11),
])
def test_sampling_is_the_race_over_training_logits(params):
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([5, 17, 2, 9], seed=1)
    engine = make_engine(model, num_kv_blocks=16, max_num_batched_tokens=12)
    outs = engine.generate(prompts, params)
    assert engine.last_stats["preemptions"] > 0
    assert [(o.prompt_index, o.sample_index) for o in outs] == [(i, k) for i in range(4) for k in range(params.n)]
    for o in outs:
        check_against_training_forward(model, o, params)
    # The n samples of a prompt differ (distinct keys), yet share the prompt's prefill.
    assert outs[0].token_ids != outs[1].token_ids


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=5),
    SamplingParams(n=2, temperature=1.3, top_k=7, top_p=0.8, max_tokens=12, seed=11),
])
def test_a_capped_models_tokens_are_the_race_over_its_capped_training_logits(params):
    """A Gemma 2 (final cap 3, which bites on these logits), whose engine LM head returns the logits uncapped and
    whose sampler caps them (in the race; with top-k / top-p before the threshold): greedy, sampled and truncated
    tokens are the race over the training forward's capped logits, the log-probs their log_softmax (chunked prefill
    and preemption on the way)."""
    model = tiny_model(tiny_args("gemma2"))
    prompts = prompts_of([5, 17, 2, 9], seed=1)
    engine = make_engine(model, num_kv_blocks=16, max_num_batched_tokens=12)
    outs = engine.generate(prompts, params)
    assert engine.last_stats["preemptions"] > 0 and engine.runner.sampler.softcap == 3.0
    for o in outs:
        check_against_training_forward(model, o, params)


def test_samples_do_not_depend_on_batching_or_preemption():
    model = tiny_model(tiny_args("llama"))
    prompts = prompts_of([6, 11, 3, 19, 8], seed=2)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True)
    roomy = make_engine(model).generate(prompts, params)
    tight_engine = make_engine(model, num_kv_blocks=10, max_num_seqs=4, max_num_batched_tokens=8)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.last_stats["preemptions"] > 0 and tight_engine.last_stats["prefill_steps_decoding"] > 0
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-5, rtol=0)


def test_more_samples_than_max_num_seqs_are_the_samples_one_group_draws():
    """n above max_num_seqs (vLLM runs it; the engine used to refuse it): a prompt's samples go in as groups
    of at most max_num_seqs, each its own prefill, and they are the samples an engine with room for all of
    them draws, in the same order (sample i's noise is keyed by i, whatever group runs it)."""
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([7, 4, 12], seed=5)
    params = SamplingParams(n=5, temperature=1.0, max_tokens=6, seed=9, ignore_eos=True)
    roomy = make_engine(model, max_num_seqs=16).generate(prompts, params)
    tight_engine = make_engine(model, max_num_seqs=2)
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.last_stats["prefill_steps"] >= 9  # 3 prompts x 3 groups (2 + 2 + 1), two slots at a time
    assert [(o.prompt_index, o.sample_index) for o in tight] == [(i, k) for i in range(3) for k in range(5)]
    assert len({tuple(o.token_ids) for o in roomy}) == 15  # distinct samples: a group repeating another's fails
    for a, b in zip(roomy, tight):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-5, rtol=0)


def test_continued_samples_draw_as_one_uninterrupted_call():
    """A multi-turn rollout continues each sample with `sample_keys`: cut after its first turn and
    continued with nothing appended, a sample is token for token the one uninterrupted call; with
    tokens appended it stays the race over the training logits under its own key (fresh positions);
    `max_tokens` per prompt bounds each continuation."""
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([4, 9, 6], seed=5)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    engine = make_engine(model)
    whole = engine.generate(prompts, params, prompt_index_offset=10)
    first = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=5, seed=7, ignore_eos=True),
                            prompt_index_offset=10)
    keys = [(o.prompt_index, o.sample_index) for o in first]
    assert keys == [(10 + i, k) for i in range(3) for k in range(2)]
    contexts = [prompts[i // 2] + o.token_ids for i, o in enumerate(first)]
    rest = engine.generate(contexts, SamplingParams(n=1, temperature=1.0, max_tokens=99, seed=7, ignore_eos=True),
                           sample_keys=keys, max_tokens=[7] * 6)
    for w, a, b in zip(whole, first, rest):
        assert (b.prompt_index, b.sample_index) == (w.prompt_index, w.sample_index)
        assert a.token_ids + b.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs + b.logprobs), torch.tensor(w.logprobs), atol=5e-5, rtol=0)
    # Tokens appended between turns (a tool's response): each row keeps its key and its own limit.
    appended = [c + [5, 6, 7] for c in contexts]
    limits = [1, 2, 3, 4, 5, 6]
    more = engine.generate(appended, SamplingParams(n=1, temperature=1.0, max_tokens=99, seed=7, ignore_eos=True),
                           sample_keys=keys, max_tokens=limits)
    assert [len(o.token_ids) for o in more] == limits
    for o in more:
        check_against_training_forward(model, o, SamplingParams(temperature=1.0, seed=7))
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="n must be 1"):
        engine.generate(prompts, SamplingParams(n=2, max_tokens=2), sample_keys=keys[:3])
    with pytest.raises(ValueError, match="repeat"):
        engine.generate(prompts, sp, sample_keys=[(0, 0)] * 3)
    with pytest.raises(ValueError, match="at least 1"):
        engine.generate(prompts, sp, max_tokens=[1, 0, 1])


@pytest.mark.parametrize("blocks, slots", [(256, 256), (8, 2)])
def test_kept_kv_continues_samples_as_a_recompute_would(blocks, slots):
    """`keep_kv`: turn 2 prefills only the appended tokens of each kept sample and samples exactly
    what a recompute of the whole context samples. Samples of one prompt share its blocks (n = 2,
    block size 4), and a first turn of one token leaves a sample's next position in the prompt's
    shared partial block: extending it copies that block. With 8 blocks and 2 slots the kept
    samples, and the queued continued ones, give theirs back under pressure (recomputed instead),
    with the same tokens."""
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([6, 9, 5], seed=8)
    engine = make_engine(model, num_kv_blocks=blocks, max_num_seqs=slots)
    prompt_limits = [1, 4, 3]  # prompt 0's samples stop after 1 token: they continue inside the shared block
    first_limits = [lim for lim in prompt_limits for _ in range(2)]
    turn = SamplingParams(n=1, temperature=1.0, max_tokens=99, seed=4, ignore_eos=True)
    keys = [(i, k) for i in range(3) for k in range(2)]
    contexts = [prompts[i] for i, _ in keys]

    def two_turns(keep: bool):
        # turn 1 as the trainer's first turn: one prefill per prompt, its 2 samples forked from it
        first = engine.generate(prompts, dataclasses.replace(turn, n=2), max_tokens=prompt_limits, keep_kv=keep)
        assert [(o.prompt_index, o.sample_index) for o in first] == keys
        second_in = [c + o.token_ids + [7, 8, 9] for c, o in zip(contexts, first)]
        second = engine.generate(second_in, turn, sample_keys=keys, max_tokens=[6] * 6)
        return first, second, engine.last_stats["reused_kv_tokens"]

    plain_first, plain_second, none = two_turns(False)
    kept_first, kept_second, reused = two_turns(True)
    assert none == 0
    if blocks == 256:  # every sample's context but its last sampled token
        assert reused == sum(len(c) + lim - 1 for c, lim in zip(contexts, first_limits))
    else:
        assert reused < sum(len(c) + lim - 1 for c, lim in zip(contexts, first_limits))
    for a, b in zip(plain_first + plain_second, kept_first + kept_second):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-5, rtol=0)
    # nothing kept after a call without keep_kv; a context that does not extend the kept tokens recomputes
    assert not engine._kept
    engine.generate(contexts, turn, sample_keys=keys, max_tokens=[2] * 6, keep_kv=True)
    engine.generate([c[:-1] + [1, 2, 3] for c in contexts], turn, sample_keys=keys, max_tokens=[2] * 6)
    assert engine.last_stats["reused_kv_tokens"] == 0


TURNS = 3


def _turn_limit(key, t):  # new tokens of sample `key`'s turn t: the samples' turns end at different steps
    return 1 + (3 * key[0] + 2 * key[1] + t) % 5


def _tool_answer(key, t):  # tokens appended to sample `key` before its turn t
    return [7, 8, 9][:1 + (key[0] + t) % 3]


def _turns_in_separate_calls(engine, prompts, turn):
    """Each sample's TURNS turns with every turn one call over all samples (the lockstep loop)."""
    first = engine.generate(prompts, dataclasses.replace(turn, n=2), max_tokens=[_turn_limit((i, 0), 0)
                                                                                 for i in range(len(prompts))])
    turns = {(o.prompt_index, o.sample_index): [o] for o in first}
    contexts = {key: prompts[key[0]] + outs[0].token_ids for key, outs in turns.items()}
    for t in range(1, TURNS):
        keys = list(turns)
        outs = engine.generate([contexts[k] + _tool_answer(k, t) for k in keys], turn, sample_keys=keys,
                               max_tokens=[_turn_limit(k, t) for k in keys])
        for k, o in zip(keys, outs):
            turns[k].append(o)
            contexts[k] = o.prompt_token_ids + o.token_ids
    return turns


@pytest.mark.parametrize("blocks, slots", [(256, 256), (10, 3)])
@pytest.mark.parametrize("when", ["at_once", "when_idle"])
def test_requests_joining_a_running_call_sample_what_separate_calls_sample(blocks, slots, when):
    """`generate(on_finish=...)`: each sample's next turn joins the running call as soon as its
    turn ends (or, `when_idle`, only once the engine has nothing left to run), continued from its
    kept K/V, and samples token for token what one call per turn samples, with variable turn
    lengths so that the turns end at different steps. With 10 blocks and 3 slots the kept K/V goes
    back under pressure (recomputed instead), with the same tokens."""
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([6, 9, 5], seed=8)
    turn = SamplingParams(n=1, temperature=1.0, max_tokens=99, seed=4, ignore_eos=True)
    reference = _turns_in_separate_calls(make_engine(model), prompts, turn)

    engine = make_engine(model, num_kv_blocks=blocks, max_num_seqs=slots)
    turns, deferred, calls, seen = {}, [], [], []

    def on_finish(outs, idle):
        calls.append((len(outs), idle))
        seen.extend(outs)
        for o in outs:
            key = (o.prompt_index, o.sample_index)
            turns.setdefault(key, []).append(o)
            t = len(turns[key])
            if t < TURNS:
                deferred.append(Continuation(o.prompt_token_ids + o.token_ids + _tool_answer(key, t), key,
                                             _turn_limit(key, t)))
        if when == "at_once" or idle:
            out = list(deferred)
            deferred.clear()
            return out
        return []

    ended = engine.generate(prompts, dataclasses.replace(turn, n=2), max_tokens=[_turn_limit((i, 0), 0) for i in
                                                                                  range(3)], keep_kv=True,
                            on_finish=on_finish)
    assert turns.keys() == reference.keys()
    for key, ref in reference.items():
        assert [o.token_ids for o in turns[key]] == [o.token_ids for o in ref]
        assert [o.prompt_token_ids for o in turns[key]] == [o.prompt_token_ids for o in ref]
        for a, b in zip(turns[key], ref):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=5e-5, rtol=0)
    assert ended == seen  # every output, in the order the calls got them
    continuations = [o for outs in turns.values() for o in outs[1:]]
    context_kv = sum(len(o.prompt_token_ids) - len(_tool_answer((o.prompt_index, o.sample_index), t + 1)) - 1
                     for outs in turns.values() for t, o in enumerate(outs[1:]))
    if blocks == 256:  # every continuation's context but its tool answer and its last sampled token
        assert engine.last_stats["reused_kv_tokens"] == context_kv
    else:
        assert 0 < engine.last_stats["reused_kv_tokens"] < context_kv
    if when == "at_once":  # each turn joined while others still ran: one idle call, at the very end
        assert sum(idle for _, idle in calls) == 1 and calls[-1] == (0, True)
    assert len(continuations) == 6 * (TURNS - 1)


def test_requests_joining_a_running_call_are_checked():
    """A continuation of a sample still running, without room for new tokens, or with tokens
    outside the vocabulary is an error naming the sample."""
    model = tiny_model(tiny_args("qwen2"))
    prompts = prompts_of([6, 9], seed=8)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=3, seed=4, ignore_eos=True)
    for bad, match in ((lambda o: Continuation([1, 2], (1 - o.prompt_index, 0), 2), "still running"),
                       (lambda o: Continuation([1, 2], (o.prompt_index, o.sample_index), 0), "at least 1"),
                       (lambda o: Continuation([1, VOCAB], (o.prompt_index, o.sample_index), 2), "outside the vocab")):
        engine = make_engine(model, max_num_seqs=2)
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params, on_finish=lambda outs, idle, bad=bad: [bad(o) for o in outs[:1]])


def test_only_decoding_rows_of_a_prefill_step_may_lack_their_token_on_the_host():
    from rollout.sequence import PLACEHOLDER, ScheduledBatch, Sequence

    runner = make_engine(tiny_model(tiny_args("qwen2"))).runner
    seq = Sequence(seq_id=0, prompt_index=0, sample_index=0, token_ids=[3, 4, PLACEHOLDER, PLACEHOLDER],
                   num_prompt_tokens=2, max_len=8, slot=0)

    def step(decoding: int):
        return ScheduledBatch(is_prefill=True, seqs=[seq], slots=[0], starts=[2], chunk_lens=[1], sample_seqs=[seq],
                              sample_slots=[0], sample_src=[0], sample_positions=[3], num_decode_rows=decoding)

    assert runner._prefill_arrays(step(1))["ids"].tolist() == [PLACEHOLDER]  # filled on the device
    with pytest.raises(RuntimeError, match="value is unknown"):
        runner._prefill_arrays(step(0))  # a prompt chunk: its tokens must be known


def test_stop_conditions():
    model = tiny_model(tiny_args("llama"))  # eos_token_id = 3
    engine = make_engine(model)
    prompts = prompts_of([5, 8, 12], seed=4)
    free = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    stop = free[1].token_ids[4]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop],
                                                   ignore_eos=True))
    for f, o in zip(free, outs):
        if stop in f.token_ids:
            cut = f.token_ids.index(stop) + 1
            assert o.token_ids == f.token_ids[:cut] and o.finish_reason == "stop"
            assert len(o.logprobs) == cut
        else:
            assert o.token_ids == f.token_ids and o.finish_reason == "length"
    # EOS from the model config stops unless ignored; an explicit eos_token_id overrides it.
    eos = SamplingParams(temperature=0, max_tokens=20, eos_token_id=stop)
    assert [o.token_ids for o in engine.generate(prompts, eos)] == [o.token_ids for o in outs]
    # max_model_len caps the response.
    capped = make_engine(model, max_model_len=10)
    out = capped.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_param_slots_are_views_of_the_engine_weights():
    model = tiny_model(tiny_args("qwen2"))
    engine = make_engine(model)
    slots = engine.param_slots()
    params = dict(model.named_parameters())
    assert set(slots) == set(params) and "lm_head.weight" not in slots  # tied
    storage = engine.model.storage.untyped_storage().data_ptr()
    for name, slot in slots.items():
        assert isinstance(slot, ParamSlot) and slot.shard_dim == tp_shard_dim(name)
        assert slot.view.untyped_storage().data_ptr() == storage
        assert torch.equal(slot.view, params[name].detach())
    # Writing through the slots (as the resharder does) is the same as load_weights.
    fresh = LLMEngine(model.args, engine.config, device="cpu")
    with torch.no_grad():
        for name, slot in fresh.param_slots().items():
            slot.view.copy_(params[name])
    prompts = prompts_of([4, 9], seed=5)
    sp = SamplingParams(temperature=0.9, max_tokens=6)
    assert [o.token_ids for o in fresh.generate(prompts, sp)] == [o.token_ids for o in engine.generate(prompts, sp)]


def test_free_and_reallocate_cache_and_weights():
    model = tiny_model(tiny_args("llama"))
    engine = make_engine(model, free_cache_engine=False)
    prompts = prompts_of([4, 9], seed=6)
    sp = SamplingParams(temperature=0, max_tokens=5)
    ref = [o.token_ids for o in engine.generate(prompts, sp)]
    assert engine.runner.kv_cache is not None  # kept: free_cache_engine=False
    engine.free_cache()
    assert engine.runner.kv_cache is None
    assert [o.token_ids for o in engine.generate(prompts, sp)] == ref  # re-allocated by generate
    slots = engine.param_slots()
    storage = engine.model.storage
    engine.free_weights()
    assert storage.untyped_storage().nbytes() == 0  # the memory itself is gone, not only a reference
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(prompts, sp)
    # What the resharder does at every reshard: ask for the slots (re-allocating) and write them.
    again = engine.param_slots()
    assert engine.model.storage is storage and storage.untyped_storage().nbytes() == storage.numel() * storage.element_size()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, slot in again.items():
            assert slot.view is slots[name].view  # the same tensor objects, over the new memory
            slot.view.copy_(params[name])
    assert all(torch.equal(slots[n].view, params[n]) for n in slots)
    assert [o.token_ids for o in engine.generate(prompts, sp)] == ref
    engine.free_weights()
    engine.init_weights_storage()
    engine.load_weights(model.named_parameters())
    assert [o.token_ids for o in engine.generate(prompts, sp)] == ref
    default = make_engine(model)  # free_cache_engine=True releases after every call
    default.generate(prompts, sp)
    assert default.runner.kv_cache is None


def test_free_weights_keeps_the_graphs_which_only_a_moved_buffer_or_free_graphs_drops():
    """The bookkeeping behind `free_engine_weights` without recapture (CPU: stand-ins for graphs):
    `free_weights()` leaves the graphs; the next generation keeps them while the weights and the KV
    pool sit where the graphs were captured, and drops them when either moved; `free_graphs()`
    drops them and the padded prefill's buffers. tests/gpu/test_engine_gpu.py runs real graphs."""
    engine = make_engine(tiny_model(tiny_args("llama")))
    runner = engine.runner
    engine.init_cache()
    runner._check_graphs()  # the key of the current buffers
    graph, prefill = object(), object()
    runner.graphs[(4, None)] = graph
    runner.prefill_graphs[("prefill", 64)] = prefill
    engine.free_weights()
    assert not engine.model.allocated and runner.graphs == {(4, None): graph}
    engine.init_weights_storage()
    key = runner._graph_key
    runner._graph_key = (engine.model.storage.data_ptr(),) + key[1:]  # back in place
    runner._check_graphs()
    assert runner.graphs == {(4, None): graph} and runner.prefill_graphs == {("prefill", 64): prefill}
    here = runner._graph_key
    for moved in (0, 2):  # captured over other weights, or over another KV pool
        runner._graph_key = here[:moved] + (here[moved] + 4096,) + here[moved + 1:]
        runner.graphs[(4, None)], runner.prefill_graphs[("prefill", 64)] = graph, prefill
        runner._check_graphs()
        assert not runner.graphs and not runner.prefill_graphs, moved
        assert runner._graph_key == here
    runner.graphs[(4, None)] = graph
    runner._pre_h = torch.zeros(1)
    engine.free_graphs()
    assert not runner.graphs and runner._pre_h is None


def test_cuda_graphs_under_cudamallocasync_are_refused_up_front(monkeypatch):
    """Under PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync the first capture died inside Triton
    (a pointer "cannot be accessed", then an abort at exit; H200, BENCHMARKS.md "Twenty-third
    pass"); eager engines run there. The check reads only the allocator's name."""
    from rollout.engine import check_allocator

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with pytest.raises(ValueError, match="backend:cudaMallocAsync.*enforce_eager=true"):
        check_allocator(cuda, enforce_eager=False)
    check_allocator(cuda, enforce_eager=True)
    check_allocator(torch.device("cpu"), enforce_eager=False)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    check_allocator(cuda, enforce_eager=False)


def test_bad_inputs_are_clear_errors():
    args = tiny_args("qwen2")
    model = tiny_model(args)
    engine = make_engine(model, max_model_len=16)
    sp = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], sp)
    with pytest.raises(ValueError, match="no room"):
        engine.generate([[1] * 16], sp)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[VOCAB]], sp)
    # the TP sizes the engine cannot split a model over (vLLM's refusals); 4 KV heads over 2 ranks, or 2
    # replicated over 4 ranks, are split (tests/multiproc/test_engine_tp_replicated.py)
    with pytest.raises(ValueError, match=r"needs num_key_value_heads \(3\) divisible by 2, or 2 divisible by it"):
        check_tp_divisibility(tiny_args("qwen2", num_attention_heads=6, num_key_value_heads=3, head_dim=16), 2)
    with pytest.raises(ValueError, match=r"needs num_attention_heads \(4\) divisible by 8"):
        check_tp_divisibility(args, 8)
    with pytest.raises(ValueError, match=r"needs intermediate_size \(128\) divisible by 3"):
        check_tp_divisibility(tiny_args("qwen2", num_attention_heads=6, num_key_value_heads=3, head_dim=16), 3)
    check_tp_divisibility(args, 4)
    # a vocabulary the TP size does not divide is padded (tests/multiproc/test_engine_tp_vocab_padding.py), but
    # not so far that a rank holds padding alone: 5 ids in shards of 2 over 4 ranks
    with pytest.raises(ValueError, match=r"needs vocab_size \(5\) above 6: in shards of 2 ids the last rank would"):
        check_tp_divisibility(tiny_args("qwen2", vocab_size=5), 4)
    check_tp_divisibility(tiny_args("qwen2", vocab_size=97), 2)
    with pytest.raises(ValueError, match="no parameter"):
        engine.load_weights([("layers.9.mlp.up_proj.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights([("norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="chunked"):
        LLMEngine(args, EngineConfig(dtype=torch.float32, enable_chunked_prefill=False, max_num_batched_tokens=64),
                  device="cpu")
    with pytest.raises(ValueError, match="prefill_graph_max_tokens"):
        EngineConfig(prefill_graph_max_tokens=-1)


@pytest.mark.parametrize("cap", [12, 700, 8192])
def test_prefill_buckets_bound_the_padding(cap):
    """A prefill step of t tokens runs padded to prefill_bucket(t): never fewer tokens, never more
    than the cap, at most PREFILL_TILE or twice t up to PREFILL_BUCKET_STEP (128) tokens and less
    than PREFILL_BUCKET_STEP more above."""
    from rollout.attention import PREFILL_TILE
    from rollout.runner import PREFILL_BUCKET_STEP, prefill_bucket

    buckets = [prefill_bucket(t, cap) for t in range(1, cap + 1)]
    assert buckets == sorted(buckets) and buckets[-1] == cap
    for t, b in enumerate(buckets, start=1):
        assert t <= b <= cap
        assert b < PREFILL_BUCKET_STEP + t if t > PREFILL_BUCKET_STEP else b <= max(PREFILL_TILE, 2 * t - 1)
    if cap == 8192:  # 64, 128, then 256 ... 8192 by 128
        assert PREFILL_BUCKET_STEP == 128 and len(set(buckets)) == 2 + 63
    if cap == 700:  # the refill of one 128-token prompt beside 255 decoding rows pads by one token
        assert prefill_bucket(383, cap) == 384 and prefill_bucket(700, cap) == 700


def _save_checkpoint(model, path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(path)


def test_cli_generate(tmp_path, capsys):
    from rollout.generate import main

    model = tiny_model(tiny_args("llama", eos_token_id=None))
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(model, ckpt)
    prompts = prompts_of([3, 7], seed=7)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt_token_ids": prompts[0]}) + "\n\n"
                   + json.dumps({"prompt": " ".join(f"w{t}" for t in prompts[1])}) + "\n")
    out = tmp_path / "out.jsonl"
    rc = main(["--model", str(ckpt), "--prompts", str(inp), "--out", str(out), "--max-new-tokens", "6",
               "--temperature", "0", "--n", "2", "--dtype", "float32"])
    assert rc == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["prompt_index"], x["sample_index"]) for x in lines] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for x in lines:
        p = prompts[x["prompt_index"]]
        assert x["prompt_token_ids"] == p
        assert x["token_ids"] == greedy_reference(model, p, 6)
        assert len(x["logprobs"]) == 6 and x["finish_reason"] == "length"
        assert x["text"] == " ".join(f"w{t}" for t in x["token_ids"])

    # --quantization fp8 and --kv-cache-dtype fp8 reach the engine: its samples are those of such an engine on
    # the same weights
    for flag, cfg in (("--quantization", {"quantization": "fp8"}), ("--kv-cache-dtype", {"kv_cache_dtype": "fp8"})):
        fp8_out = tmp_path / "fp8.jsonl"
        assert main(["--model", str(ckpt), "--prompts", str(inp), "--out", str(fp8_out), "--max-new-tokens", "6",
                     "--temperature", "0", "--dtype", "float32", flag, "fp8"]) == 0
        expect = make_engine(model, **cfg).generate(prompts, SamplingParams(temperature=0, max_tokens=6))
        got = [json.loads(x) for x in fp8_out.read_text().splitlines()]
        assert [x["token_ids"] for x in got] == [o.token_ids for o in expect]
        assert [x["logprobs"] for x in got] == [o.logprobs for o in expect]
        assert [x["logprobs"] for x in got] != [x["logprobs"] for x in lines if x["sample_index"] == 0]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_token_ids": [1]}) + "\n{not json\n")
    assert main(["--model", str(ckpt), "--prompts", str(bad), "--out", str(out), "--max-new-tokens", "2"]) == 2
    assert f"{bad}:2" in capsys.readouterr().err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt_token_ids": [1] * 128}) + "\n")
    assert main(["--model", str(ckpt), "--prompts", str(long), "--out", str(out), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert f"{long}:1" in err and "context" in err
    assert main(["--model", str(ckpt), "--prompts", str(tmp_path / "missing.jsonl"), "--out", str(out),
                 "--max-new-tokens", "2"]) == 2
    assert "does not exist" in capsys.readouterr().err

    # the disk fills while the results are written: one line, the earlier --out file as it was, no temporary
    import errno
    from unittest import mock

    before = out.read_bytes()
    with mock.patch("rollout.generate.os.replace", side_effect=OSError(errno.ENOSPC, "No space left on device")):
        assert main(["--model", str(ckpt), "--prompts", str(inp), "--out", str(out), "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == (f"rollout.generate: error: --out {str(out)!r}: writing the results failed (No "
                                       "space left on device); the earlier file is unchanged\n")
    assert out.read_bytes() == before and not (tmp_path / ".out.jsonl.tmp").exists()


def test_cli_generate_chat_message_prompts(tmp_path, capsys):
    """A 'prompt' of chat messages is rendered by the tokenizer's chat template with the generation prompt and
    tokenized without added special tokens (as the trainer's datasets do); `--no-chat-template` joins the
    contents by newlines; messages without a template, or malformed, are one-line errors naming the line."""
    from rollout.generate import main
    from transformers import AutoTokenizer

    model = tiny_model(tiny_args("llama", eos_token_id=None))
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(model, ckpt)
    plain = tmp_path / "plain"
    _save_checkpoint(model, plain)
    tok = AutoTokenizer.from_pretrained(ckpt)  # role tokens w1 / w2, w3 opens the assistant's turn
    tok.chat_template = ("{% for m in messages %}{{ 'w1' if m['role'] == 'system' else 'w2' }} {{ m['content'] }} "
                         "{% endfor %}{% if add_generation_prompt %}w3{% endif %}")
    tok.save_pretrained(ckpt)
    messages = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w5 w6 w7"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"prompt": messages}) + "\n")
    out = tmp_path / "out.jsonl"
    common = ["--prompts", str(inp), "--out", str(out), "--max-new-tokens", "5", "--temperature", "0",
              "--dtype", "float32"]
    for extra, ids in (([], [1, 9, 8, 2, 5, 6, 7, 3]), (["--no-chat-template"], [9, 8, 5, 6, 7])):
        assert main(["--model", str(ckpt)] + common + extra) == 0
        (line,) = [json.loads(x) for x in out.read_text().splitlines()]
        assert line["prompt_token_ids"] == ids
        assert line["token_ids"] == greedy_reference(model, ids, 5)
    bad = tmp_path / "bad.jsonl"
    for model_dir, prompt, message in (
            (plain, messages, "is a list of chat messages but the tokenizer has no chat template; use text "
                              "prompts, set --no-chat-template"),
            (ckpt, [{"role": "user"}], "field 'prompt' message 0 has no 'content'"),
            (ckpt, 7, "field 'prompt' must be a string or a list of chat messages, got int")):
        bad.write_text(json.dumps({"prompt_token_ids": [1]}) + "\n" + json.dumps({"prompt": prompt}) + "\n")
        assert main(["--model", str(model_dir), "--prompts", str(bad), "--out", str(tmp_path / "o.jsonl"),
                     "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert f"{bad}:2: " in err and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_cli_generate_reads_the_trainers_prompt_files(tmp_path):
    """`--prompts` takes what `data.train_files` takes: JSON lines (with a byte-order mark, blank
    lines skipped), a .json array and .parquet, the same prompts from each; rows are numbered in
    errors as the trainer numbers them."""
    from pathlib import Path

    from data import write_records
    from rollout.generate import CLIError, read_prompts

    rows = [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + b"\n\n".join(json.dumps(r).encode() for r in rows) + b"\n")
    array = tmp_path / "p.json"
    array.write_text(json.dumps(rows))
    parquet = Path(write_records(rows, tmp_path / "p.parquet"))
    for path in (jsonl, array, parquet):
        assert read_prompts(path, None, vocab_size=16, max_model_len=8) == [[1, 2, 3], [4, 5]], path
    write_records([rows[0], {"prompt_token_ids": [99]}], parquet)
    with pytest.raises(CLIError, match=r"p\.parquet:2: token id 99 outside the vocabulary \[0, 16\)"):
        read_prompts(parquet, None, vocab_size=16, max_model_len=8)


def test_cli_generate_refuses_bad_input_before_any_work(tmp_path, capsys, monkeypatch):
    """One line naming the flag, file or line, exit 2, nothing written: an output that is the prompts
    file (it used to be replaced by the results) or a directory (found only after generating), a
    directory without weights, a prompts file that is not parquet, a NaN temperature (it wrote
    NaN log-probs) and a context of 0 (ignored) or past the model's. `--num-samples` is the
    spelling torchrun lets through (`--n` abbreviates its own options)."""
    from rollout.generate import main, parse_args

    model = tiny_model(tiny_args("llama", eos_token_id=None))
    ckpt = tmp_path / "ckpt"
    _save_checkpoint(model, ckpt)
    inp = tmp_path / "in.jsonl"
    text = json.dumps({"prompt_token_ids": prompts_of([3], seed=7)[0]}) + "\n"
    inp.write_text(text)
    (tmp_path / "dir").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text((ckpt / "config.json").read_text())
    binary = tmp_path / "in.parquet"
    binary.write_bytes(b"PAR1\xff\xfe\x00")
    common = ["--max-new-tokens", "2", "--dtype", "float32"]
    cases = [(["--model", str(ckpt), "--prompts", str(inp), "--out", str(inp)], "is the prompts file"),
             (["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "dir")], "is a directory"),
             (["--model", str(tmp_path / "noweights"), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl")],
              "has no *.safetensors"),
             (["--model", str(ckpt), "--prompts", str(binary), "--out", str(tmp_path / "o.jsonl")],
              f"{binary}: not a readable parquet file"),
             (["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl"), "--temperature", "nan"],
              "temperature must be a finite number >= 0"),
             # its reciprocal overflowed float32: a RuntimeError traceback in the sampler
             (["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl"), "--temperature",
               "1e-40"], "temperature=1e-40: a positive temperature below 1e-06 is greedy decoding in all but name"),
             (["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl"), "--max-model-len", "0"],
              "--max-model-len 0: give 2 to the model's max_position_embeddings"),
             (["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl"), "--max-model-len",
               "100000"], "--max-model-len 100000: give 2 to")]
    for argv, message in cases:
        assert main(argv + common) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("rollout.generate: error: ") and message in err and "Traceback" not in err, (argv, err)
    assert inp.read_text() == text and not (tmp_path / "o.jsonl").exists()
    assert parse_args(["--model", "m", "--prompts", "p", "--out", "o", "--max-new-tokens", "1",
                       "--num-samples", "3"]).n == 3
    # flags out of range are refused by name (they used to be reported as engine fields, or accepted)
    for flag, value in (("--max-new-tokens", "0"), ("--num-samples", "0"), ("--max-num-seqs", "-3"),
                        ("--gpu-memory-utilization", "7")):
        argv = ["--model", "m", "--prompts", "p", "--out", "o", "--max-new-tokens", "1", flag, value]
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2 and flag in capsys.readouterr().err
    # a KV pool too small for one sequence of the context: the flag that helps, in one line
    import rollout.engine as engine_mod
    monkeypatch.setattr(engine_mod, "CPU_KV_CACHE_BYTES", 1 << 12)
    assert main(["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl")] + common) == 2
    err = capsys.readouterr().err
    assert "on CPU the pool is" in err and "lower --max-model-len" in err and "Traceback" not in err, err
    monkeypatch.undo()
    # a generation_config.json that is not a JSON object names the file
    for bad in ("{bad", "[1, 2]"):
        (ckpt / "generation_config.json").write_text(bad)
        assert main(["--model", str(ckpt), "--prompts", str(inp), "--out", str(tmp_path / "o.jsonl")] + common) == 2
        err = capsys.readouterr().err
        assert "generation_config.json" in err and "Traceback" not in err, err


def test_blocks_with_watermark_is_the_smallest_pool_admitting_that_many_blocks():
    from rollout.engine import WATERMARK_FRACTION, blocks_with_watermark

    above = lambda n: n - int(WATERMARK_FRACTION * n)  # noqa: E731  (what the scheduler admits)
    for usable in range(1, 3000):
        n = blocks_with_watermark(usable)
        assert above(n) >= usable > above(n - 1), usable


def test_a_memory_sized_pool_admits_a_full_length_sequence():
    """The pool's size was checked against one full-length sequence without the admission watermark: at
    max_num_seqs=1 on CPU the cap gave exactly that many blocks, the check passed, short prompts ran, and the
    first prompt long enough to reach max_model_len failed mid-run (107 blocks needed, 107 in the pool, 1 kept
    free)."""
    from rollout import SamplingParams

    model = tiny_model(tiny_args("qwen2", max_position_embeddings=2048))
    engine = LLMEngine(model.args, EngineConfig(dtype=torch.float32, block_size=16, max_num_seqs=1,
                                                max_model_len=1700, max_num_batched_tokens=2048), device="cpu")
    engine.load_weights(model.named_parameters())
    out = engine.generate(prompts_of([1650]), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    assert len(out[0].token_ids) == 50


@pytest.mark.parametrize("head_dim", [4, 8, 24, 80, 96, 100, 128])
def test_engine_takes_the_triton_ops_for_any_head_dim(monkeypatch, head_dim):
    """Where Triton runs, the engine takes its kernels (and so CUDA graphs) whatever the head_dim: the
    RoPE and attention kernels pad a head to a power of two of at least 16 lanes (`tl.dot` reduces over
    16 or more). The kernels themselves at padded head dims: tests/unit/test_triton_kernels.py."""
    import rollout.runner

    monkeypatch.setattr(rollout.runner, "triton_usable", lambda device: True)
    args = tiny_args("llama", head_dim=head_dim)
    engine = LLMEngine(args, EngineConfig(dtype=torch.float32, block_size=4, num_kv_blocks=8), device="cpu")
    assert engine.runner.model.head_dim == head_dim and engine.runner.use_triton


@pytest.mark.parametrize("max_num_seqs, last", [(1, 1), (3, 4), (256, 256), (300, 304), (512, 512), (513, 520),
                                                (1024, 1024), (1030, 1032)])
def test_the_default_graph_ladder_holds_a_full_decode_step(max_num_seqs, last):
    """The default capture sizes (1, 2, 4, 8, then multiples of 8) end at the first one holding
    max_num_seqs sequences, so a full decode step runs as a graph: at 513 the ladder stopped at 512
    and a 513-row step ran eagerly."""
    sizes = EngineConfig(max_num_seqs=max_num_seqs).capture_sizes()
    assert sizes[-1] == last and (len(sizes) == 1 or sizes[-2] < max_num_seqs)
    assert sizes[:4] == [1, 2, 4, 8][:len(sizes[:4])] and all(s % 8 == 0 for s in sizes[4:])
