"""Routing replay (R3): `models.moe.route(..., replay=)` and the training model's `routed_experts`, on CPU in float64.
Replaying the router's own top-k computes exactly what routing computes; replaying other experts weights them by
the softmax probabilities at those ids (renormalised where norm_topk_prob, float32 where the family keeps them so)
and the router gets the gradient of those probabilities."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import ModelArgs, Transformer, cu_seqlens_from_lengths
from models.moe import experts_forward, route, route_model
from tests.unit.hf_family import one_thread

_one_thread = one_thread


# The same layers as a Qwen2-MoE: q/k/v biases and a shared expert of 24 beside each sparse layer's routed experts,
# which every token runs through unrouted (its records and replays cover the routed experts alone)
QWEN2_MOE = dict(model_type="qwen2_moe", head_dim=None, attention_bias=True, shared_expert_intermediate_size=24)
# A Granite-MoE-Shared: every layer sparse (experts intermediate_size wide), its router's softmax over the top-k logits,
# its ungated shared expert of 24 (unrouted, unrecorded) and Granite's scalars
GRANITE_MOE_SHARED = dict(model_type="granitemoeshared", head_dim=None, intermediate_size=16, mlp_only_layers=(),
                          shared_expert_intermediate_size=24, embedding_multiplier=2.0, residual_multiplier=0.5,
                          attention_multiplier=0.3, logits_scaling=2.0)


def moe_args(**kw) -> ModelArgs:
    """A 3-layer Qwen3-MoE: layers 0 and 2 sparse (6 experts of 16, top-2), layer 1 dense (`QWEN2_MOE`: a
    Qwen2-MoE's)."""
    return ModelArgs(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
                               model_type="qwen3_moe", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                               mlp_only_layers=(1,), norm_topk_prob=True), **kw})


def own_routing(model: Transformer, input_ids: torch.Tensor, **forward_kw) -> torch.Tensor:
    """`[*input_ids.shape, sparse layers, k]`: the experts each sparse layer's router picks in a forward of
    `input_ids`, read by hooks on the MoE modules (the replay-free path)."""
    picked = []

    def hook(module, inputs, _):
        x = inputs[0]
        picked.append(route_model(x.reshape(-1, x.shape[-1]), module.gate.weight, module.args)[1])

    handles = [layer.mlp.register_forward_hook(hook) for i, layer in enumerate(model.layers)
               if i in model.args.moe_layers]
    try:
        with torch.no_grad():
            model(input_ids, **forward_kw)
    finally:
        for h in handles:
            h.remove()
    return torch.stack(picked, 1).view(*input_ids.shape, len(picked), -1)


@pytest.mark.parametrize("norm, f32, topk", [(False, False, False), (True, False, False), (True, True, False),
                                             (True, False, True)])
def test_replaying_the_natural_top_k_is_routing(norm, f32, topk):
    """route(replay=its own top-k) returns the same weights and experts bit for bit (float64; with and without
    renormalisation, float32 weights as Mixtral keeps them, the softmax over the top-k logits as Granite-MoE takes
    it)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 32, generator=g, dtype=torch.float64), torch.randn(6, 32, generator=g, dtype=torch.float64)
    weights, experts = route(x, w, 2, norm, f32, softmax_topk=topk)
    again, replayed = route(x, w, 2, norm, f32, replay=experts.to(torch.uint8), softmax_topk=topk)
    assert torch.equal(replayed, experts) and torch.equal(again, weights) and again.dtype == weights.dtype


@pytest.mark.parametrize("norm", [False, True])
def test_replayed_experts_get_the_softmax_weights_and_the_router_its_gradient(norm):
    """Replayed ids that are not the top-k (the 3rd and 5th most likely expert, then two tokens' reversed order):
    their weights are the float32 softmax at those ids (renormalised where asked), and the router's gradient of
    Σ c[t, j] w[t, j] is the hand-derived one: without renormalisation, dL/dW_e = Σ_t Σ_j c_tj p_tj (δ(e, e_tj) -
    p_te) x_t; with it, by the chain rule through w = p / Σp. The softmax is taken in float32 (as every family
    takes it): the weights are those float32 values exactly, the gradient within float32's rounding (1e-5 of
    the largest, where a wrong formula is off by their size)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=g, dtype=torch.float64)
    w = torch.randn(6, 32, generator=g, dtype=torch.float64).requires_grad_()
    c = 10 * torch.randn(7, 2, generator=g, dtype=torch.float64)
    probs = torch.softmax(x @ w.detach().T, -1, dtype=torch.float32)
    order = probs.argsort(-1, descending=True)
    replay = order[:, [2, 4]].to(torch.int16)
    replay[:2] = replay[:2].flip(-1)
    weights, experts = route(x, w, 2, norm, replay=replay)
    p = probs.gather(1, replay.long())
    assert torch.equal(experts, replay.long())
    want = p / p.sum(-1, keepdim=True) if norm else p
    assert torch.equal(weights, want.double())
    p, want, probs = p.double(), want.double(), probs.double()
    (weights * c).sum().backward()
    # dL/dp_tj: c_tj, or through the renormalisation (c_tj - Σ_i c_ti w_ti) / Σ_i p_ti
    dp = (c - (c * want).sum(-1, keepdim=True)) / p.sum(-1, keepdim=True) if norm else c
    onehot = F.one_hot(replay.long(), 6).double()  # [T, k, E]
    dz = (dp[..., None] * p[..., None] * (onehot - probs[:, None, :])).sum(1)  # dL/dlogits [T, E]
    hand = dz.T @ x
    assert hand.abs().max() > 0.5
    assert (w.grad - hand).abs().max().item() <= 1e-5 * hand.abs().max().item()


def test_a_granite_moe_router_takes_the_softmax_over_the_chosen_logits():
    """Granite-MoE's routing (`softmax_topk`, GraniteMoeTopKRouter): the top-k of the logits cast to float32 and the
    softmax over those k alone, cast back (float64 here); replayed ids (the 3rd and 5th largest logits, reversed on two
    tokens) get the softmax over their own float32 logits, in their order; the router gets its gradient through
    them."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 32, generator=g, dtype=torch.float64)
    w = torch.randn(6, 32, generator=g, dtype=torch.float64).requires_grad_()
    logits = (x @ w.detach().T).float()
    top, ids = logits.topk(2, dim=-1)
    weights, experts = route(x, w, 2, True, softmax_topk=True)
    assert torch.equal(experts, ids) and torch.equal(weights, torch.softmax(top, -1).double())
    replay = logits.argsort(-1, descending=True)[:, [2, 4]]
    replay[:2] = replay[:2].flip(-1)
    weights, experts = route(x, w, 2, True, replay=replay.to(torch.uint8), softmax_topk=True)
    assert torch.equal(experts, replay) and torch.equal(weights, torch.softmax(logits.gather(1, replay), -1).double())
    weights[:, 0].sum().backward()
    assert w.grad.abs().max() > 1e-2


def test_a_replay_of_the_wrong_shape_is_refused():
    x, w = torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"replayed experts of shape \(5, 3\) for 5 tokens routed to 2"):
        route(x, w, 2, True, replay=torch.zeros(5, 3, dtype=torch.long))
    model = Transformer.build(moe_args(), seed=0).double()
    with pytest.raises(ValueError, match=r"expected \[\*input_ids.shape, 2 sparse layers, 2\]"):
        model(torch.zeros(1, 4, dtype=torch.long), routed_experts=torch.zeros(1, 4, 1, 2, dtype=torch.long))


def test_the_models_forward_replays_each_sparse_layers_experts():
    """Padded and packed layouts: replaying the model's own routing gives its logits bit for bit, and replaying
    other experts in one sparse layer changes the logits from that layer on - equal to a forward whose router of
    layer: that layer's output is its experts at those ids weighted by the renormalised softmax there."""
    args = moe_args()
    model = Transformer.build(args, seed=0).double()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    mine = own_routing(model, ids)
    assert mine.shape == (2, 9, 2, 2)
    with torch.no_grad():
        base = model(ids)
        assert torch.equal(model(ids, routed_experts=mine.to(torch.uint8)), base)
        lengths = [9, 5]
        packed = torch.cat([ids[0], ids[1, :5]])
        cu = cu_seqlens_from_lengths(lengths)
        own_packed = own_routing(model, packed, cu_seqlens=cu)
        assert torch.equal(own_packed, torch.cat([mine[0], own_routing(model, ids[1:, :5])[0]]))
        assert torch.equal(model(packed, cu_seqlens=cu, routed_experts=own_packed), model(packed, cu_seqlens=cu))

        other = mine.clone()
        other[..., 1, :] = (mine[..., 1, :] + 1) % 6  # layer 2's experts moved
        seen = []
        hook = model.layers[2].mlp.register_forward_hook(lambda m, inputs, out: seen.append((inputs[0], out)))
        diverted = model(ids, routed_experts=other)
        hook.remove()
    assert (diverted - base).abs().max() > 1e-3
    # layer 2's output: the experts `other` names, weighted by the renormalised float32 softmax at those ids
    x, out = seen[0]
    rows, chosen = x.reshape(-1, 32), other[..., 1, :].reshape(-1, 2)
    p = torch.softmax(rows @ model.layers[2].mlp.gate.weight.T, -1, dtype=torch.float32).gather(1, chosen)
    moe = model.layers[2].mlp
    want = experts_forward(rows, (p / p.sum(-1, keepdim=True)).double(), chosen, moe.experts.gate_up_proj,
                           moe.experts.down_proj)
    assert torch.equal(out.reshape(-1, 32), want)


# ---------------------------------------------------------------- the engine's record
def _engine_case(**cfg):
    from tests.unit.test_engine import make_engine, prompts_of

    model = Transformer.build(moe_args(), seed=0).double()
    engine = make_engine(model, dtype=torch.float64, return_routed_experts=True, **cfg)
    return model, engine, prompts_of([3, 13, 21, 6])


@pytest.mark.parametrize("cfg", [dict(max_num_batched_tokens=8),  # chunked prefill, decoding rows riding along
                                 dict(num_kv_blocks=24, max_num_seqs=8)])  # preemption and recompute
def test_the_engines_recorded_experts_are_the_training_models_routing(cfg):
    """Every sample's `routed_experts` (3 samples a prompt: each shared prompt prefilled once, its experts recorded
    once in its shared blocks) equals the training model's own routing of prompt + response in one forward, at
    every position but the last (sampled, never fed), in both sparse layers (float64). The prompts are
    longer than a prefill chunk (first case) or the pool forces preemptions (second)."""
    from rollout import SamplingParams

    model, engine, prompts = _engine_case(**cfg)
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5, ignore_eos=True))
    if "num_kv_blocks" in cfg:
        assert engine.last_stats["preemptions"] > 0
    else:
        assert engine.last_stats["prefill_steps"] > len(prompts)  # chunked
    assert len(outs) == 12
    for out in outs:
        tokens = out.prompt_token_ids + out.token_ids
        want = own_routing(model, torch.tensor([tokens]))[0, :-1]
        got = out.routed_experts
        assert got.dtype == torch.uint8 and got.shape == (len(tokens) - 1, 2, 2)
        assert torch.equal(got.long(), want), (out.prompt_index, out.sample_index)
    assert len({tuple(o.token_ids) for o in outs}) > 4  # the samples differ: their responses' experts too


def test_the_engine_records_nothing_unless_asked():
    from rollout import SamplingParams
    from tests.unit.test_engine import make_engine

    model = Transformer.build(moe_args(), seed=0).double()
    engine = make_engine(model, dtype=torch.float64)
    out, = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
    assert out.routed_experts is None and not engine.runner.record_routing
    before = engine.runner.kv_bytes_per_block()
    engine = make_engine(model, dtype=torch.float64, return_routed_experts=True)
    assert engine.runner.kv_bytes_per_block() == before + 4 * 2 * 2  # block_size 4: 2 layers x top-2 bytes a token


# ---------------------------------------------------------------- the trainer's forwards
def _perturbed_pair():
    """(A, B): top-1 routing with norm_topk_prob (every token's one weight is p / p = 1, whatever the router), and B
    is A with both sparse layers' routers' rows rolled by one: B routes each token elsewhere, but B replaying A's
    experts computes exactly A's forward (any misplaced id runs another expert)."""
    args = moe_args(num_experts_per_tok=1)
    a, b = Transformer.build(args, seed=0).double(), Transformer.build(args, seed=0).double()
    with torch.no_grad():
        for layer in args.moe_layers:
            b.layers[layer].mlp.gate.weight.copy_(a.layers[layer].mlp.gate.weight.roll(1, 0))
    return a, b


@pytest.mark.parametrize("layout", ["packed", "padded", "shared_prefix"])
def test_replayed_engine_routing_reaches_the_right_tokens_of_every_micro_batch(layout):
    """The engine (model A, float64, chunked prefill, 3 samples a prompt) records its routing; the batch carries it
    (`Samples` -> `RolloutBatch.routed_experts`), split into micro-batches of other rows (`take`) and laid out
    packed, padded or prefix-shared. Model B (A with its routers' rows rolled, `_perturbed_pair`) replaying it
    computes A's log-probs of the responses (float64, 1e-12; the engine's own float32 log-probs within 1e-6),
    where B routing itself is off by more than 1e-2: each token got its own experts."""
    from rollout import SamplingParams
    from tests.unit.test_engine import make_engine, prompts_of
    from trainer.forward import build_micro_batch, response_logprobs
    from trainer.rollout_batch import RolloutBatch
    from trainer.rollout_phase import Samples

    a, b = _perturbed_pair()
    engine = make_engine(a, dtype=torch.float64, return_routed_experts=True, max_num_batched_tokens=16)
    prompts = prompts_of([5, 19, 9])
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=3, ignore_eos=True))
    samples = Samples.of(outs, multi_turn=False)
    uids = [i for i in range(3) for _ in range(3)]
    n = len(outs)
    width = int(samples.token_ids.lengths().max())
    ro = RolloutBatch([prompts[u] for u in uids], samples.token_ids, uids, [None] * n, [None] * n, [{}] * n,
                      samples.finish_reasons, samples.logprobs, width, torch.device("cpu"),
                      routed_experts=samples.routed_experts)
    assert torch.equal(torch.as_tensor(ro.routed_experts.lengths()), torch.as_tensor(ro.lengths()))
    packed, share = layout != "padded", layout == "shared_prefix"
    results = {}
    for name, model, replay in (("a", a, False), ("b_replay", b, True), ("b_own", b, False)):
        rows = torch.zeros(n, width, dtype=torch.float64)
        for part in ([0, 1, 2, 3, 4], [5, 6, 7, 8]):  # two micro-batches, each prompt's samples together
            sub = ro.take(part)
            mb = build_micro_batch(sub.prompts, sub.responses, "cpu", packed, 0, None, share,
                                   sub.routed_experts if replay else None)
            if replay:
                assert mb.routed_experts.shape == (*mb.input_ids.shape, 2, 1)
            with torch.no_grad():  # the float64 logits (the LM head's chunked log-probs are float32)
                logits = model(mb.input_ids, **mb.model_kwargs()).reshape(-1, 96)[mb.src_index]
                logp = torch.log_softmax(logits, -1).gather(1, mb.src_labels[:, None])[:, 0]
                assert torch.allclose(response_logprobs(model, mb, width, 1.0, False)[0][mb.dst_row, mb.dst_col],
                                      logp.float(), atol=1e-5, rtol=0)
            rows[part] = torch.zeros(len(part), width, dtype=torch.float64).index_put((mb.dst_row, mb.dst_col), logp)
        results[name] = rows
    mask = torch.as_tensor(ro.host_response_mask()).bool()
    assert (results["b_replay"] - results["a"])[mask].abs().max().item() <= 1e-12
    assert (results["b_own"] - results["a"])[mask].abs().max().item() > 1e-2
    engine_lp = torch.as_tensor(ro.engine_log_probs.padded(width), dtype=torch.float64)
    assert (results["b_replay"] - engine_lp)[mask].abs().max().item() <= 1e-6


def test_replay_without_the_record_is_refused_and_a_wrong_length_named():
    from trainer.batching import Ragged
    from trainer.forward import build_micro_batch

    routed = Ragged.of_arrays([torch.zeros(4, 2, 2, dtype=torch.uint8).numpy()])
    with pytest.raises(ValueError, match=r"routed experts for sequences of \[4\] tokens, laid out with \[5\]"):
        build_micro_batch([[1, 2, 3]], [[4, 5]], "cpu", True, routed_experts=routed)


def test_each_ulysses_rank_gets_the_routed_experts_of_its_shard():
    """Ulysses (5 ranks, packed, shared prefix): each rank's `routed_experts` is its token range of the whole row's,
    the padding's 0, and the whole row's are each token's own (a row's ids are its tokens' values here)."""
    from sharding.ulysses import SequenceParallel
    from trainer.batching import Ragged
    from trainer.forward import build_micro_batch

    prompts, responses = [[1, 2, 3], [1, 2, 3], [7, 8]], [[4, 5], [6], [9, 10, 11, 12]]
    # each token's "experts": its token id in layer 0, 100 + id in layer 1
    routed = Ragged.of_arrays([np.stack([np.array(p + r), 100 + np.array(p + r)], 1)[:, :, None].astype(np.uint8)
                               for p, r in zip(prompts, responses)])
    whole = build_micro_batch(prompts, responses, "cpu", True, 0, None, True, routed)
    ids = whole.input_ids
    assert torch.equal(whole.routed_experts[..., 0, 0].long(), ids)
    assert torch.equal(whole.routed_experts[..., 1, 0].long(), ids + 100)
    shards = [build_micro_batch(prompts, responses, "cpu", True, 0, SequenceParallel(None, 5, r), True, routed)
              for r in range(5)]
    joined = torch.cat([s.routed_experts for s in shards], 1)
    assert joined.shape[1] == 15 and ids.shape[1] == 12  # 12 tokens (the prompt [1, 2, 3] once), padded to 15
    assert torch.equal(joined[:, :12], whole.routed_experts) and not joined[:, 12:].any()
    for s in shards:
        assert torch.equal(s.routed_experts[..., 0, 0].long()[s.input_ids != 0], s.input_ids[s.input_ids != 0])


# ---------------------------------------------------------------- R2: the old-log-prob pass's own routing
LAYOUTS = ["packed", "padded", "shared_prefix"]


def r2_rollouts(seed: int = 0, device="cpu"):
    """9 rows: 3 prompts (4, 11 and 7 tokens) with 3 responses each (1 to 8 tokens), advantages set."""
    from trainer.rollout_batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (4, 11, 7)]
    uids = [u for u in range(3) for _ in range(3)]
    responses = [torch.randint(1, 96, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                 for _ in uids]
    n, width = len(uids), max(map(len, responses))
    ro = RolloutBatch([prompts[u] for u in uids], responses, uids, [None] * n, [None] * n, [{}] * n, ["stop"] * n,
                      [[0.0] * len(r) for r in responses], width, torch.device(device))
    ro.advantages = torch.randn(n, width, generator=g).to(device) * ro.response_mask
    return ro


def r2_actor(model, layout: str, micro: int = 4, sp=None, device="cpu"):
    """An R2 actor of `model` in `layout` (old-log-prob micro-batches of `micro` rows; `sp`: its Ulysses group), whose
    optimizer steps change nothing (SGD at learning rate 0): what its forwards route is the test's subject."""
    from trainer.roles import Actor, MicroBatching

    return Actor(model, torch.optim.SGD(model.parameters(), lr=0.0), None, packed=layout != "padded",
                 share_prefix=layout == "shared_prefix", temperature=1.0, pad_token_id=0, device=torch.device(device),
                 world_size=1, response_length=8, batching=MicroBatching(micro, False, 0), sp=sp, router_replay="R2")


def check_record_is_each_rows_routing(model, ro) -> None:
    """`ro.routed_experts` (the R2 pass's record) is, row by row, the experts the model's routers pick for every
    token of prompt + response in a forward of that row alone (uint8, float64 model)."""
    record = ro.routed_experts
    assert record.flat.dtype == np.uint8 and np.array_equal(record.lengths(), ro.lengths())
    for i, (prompt, response) in enumerate(zip(ro.prompts, ro.responses)):
        want = own_routing(model, torch.tensor([prompt + response]))[0]
        got = torch.from_numpy(record.flat[record.offsets[i]:record.offsets[i + 1]]).long()
        assert torch.equal(got, want), i


@pytest.mark.parametrize("layout, family", [(layout, {}) for layout in LAYOUTS] + [
    ("shared_prefix", QWEN2_MOE), ("shared_prefix", GRANITE_MOE_SHARED)])
def test_the_r2_record_is_each_tokens_routing_and_replays_as_routing(layout, family):
    """The R2 old-log-prob pass (Actor.log_probs, micro-batches of 4 rows, the shared prompts laid out once per
    micro-batch under prefix sharing) records into `ro.routed_experts` every token's experts in both sparse layers:
    each row's are its own routing (a forward of the row alone; the shared prompt's record reaches every row of its
    group), and laid out again in other micro-batches (5 and 4 rows) a forward replaying them computes the logits of
    the forward that routes at every token, bit for bit (float64); a Qwen2-MoE's shared expert, which no record holds,
    computed alike on both (a Granite-MoE-Shared's, every layer sparse, too)."""
    from trainer.forward import build_micro_batch

    model = Transformer.build(moe_args(**family), seed=0).double()
    ro = r2_rollouts()
    assert ro.routed_experts is None
    actor = r2_actor(model, layout)
    with torch.no_grad():
        old, ent = actor.log_probs(ro, with_entropy=True)
    assert old.shape == ent.shape == (9, ro.width) and ro.routed_experts is not None
    check_record_is_each_rows_routing(model, ro)
    packed, share = layout != "padded", layout == "shared_prefix"
    for part in ([0, 1, 2, 3, 4], [5, 6, 7, 8]):
        sub = ro.take(part)
        mine = build_micro_batch(sub.prompts, sub.responses, "cpu", packed, 0, None, share)
        replayed = build_micro_batch(sub.prompts, sub.responses, "cpu", packed, 0, None, share, sub.routed_experts)
        real = (mine.attention_mask if mine.attention_mask is not None else torch.ones_like(mine.input_ids)).bool()
        with torch.no_grad():  # (a padding token, which no real one attends to, replays expert 0)
            assert torch.equal(model(replayed.input_ids, **replayed.model_kwargs())[real],
                               model(mine.input_ids, **mine.model_kwargs())[real])


def _no_step(model, optimizer, grad_clip, step=-1):
    """The update's optimizer step for a float64 model whose step changes nothing (learning rate 0): the gradients
    dropped (the grad-norm clip takes float32 gradients only)."""
    optimizer.zero_grad(set_to_none=True)
    return torch.zeros(()), torch.zeros(())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_r2_update_replays_pi_olds_experts_after_the_routers_change(layout, monkeypatch):
    """R2 in an update after the routers changed: the pass records A's routing (`_perturbed_pair`'s top-1 model A),
    then the actor's routers become B's (rolled: each token routes elsewhere). Every forward of the update (2 epochs x
    3 mini-batches x 2 micro-batches; the optimizer's steps change nothing) replays A's experts: its log-probs are A's,
    routing itself, of the same rows in the same layout (float64 model, 1e-12), where B routing itself is off by more
    than 1e-2. An on-policy update (one mini-batch, one epoch) that skipped the pass (old_log_probs None) routes
    itself: its one step's forwards run pi_old's own routing, which is B's here."""
    from tests.unit.test_batching import _actor_cfg
    from trainer.forward import build_micro_batch, response_logprobs

    a, b = _perturbed_pair()
    reference_a = Transformer.build(a.args, seed=0).double()  # A, as it was
    actor = r2_actor(a, layout)
    ro = r2_rollouts()
    with torch.no_grad():
        ro.old_log_probs, _ = actor.log_probs(ro)
        for layer in a.args.moe_layers:
            a.layers[layer].mlp.gate.weight.copy_(b.layers[layer].mlp.gate.weight)
    seen = []
    forward = actor._forward

    def spy(sub, *args, **kw):
        out = forward(sub, *args, **kw)
        seen.append((sub, out[0].detach()))
        return out

    actor._forward = spy
    monkeypatch.setattr("trainer.roles._grad_norm_and_step", _no_step)
    cfg = _actor_cfg(ppo_epochs=2, ppo_micro_batch_size_per_gpu=2, entropy_coeff=0.0, use_kl_loss=False)
    packed, share = layout != "padded", layout == "shared_prefix"

    def gaps(model):
        """The largest |log-prob - `model`'s own| over the update's forwards."""
        worst = 0.0
        for sub, logp in seen:
            mb = build_micro_batch(sub.prompts, sub.responses, "cpu", packed, 0, None, share)
            with torch.no_grad():
                want = response_logprobs(model, mb, sub.width, 1.0, False)[0]
            worst = max(worst, (logp - want)[sub.response_mask.bool()].abs().max().item())
        return worst

    actor.update(ro, cfg, num_mini_batches=3, kl_loss_coef=0.0, seed=0)
    assert len(seen) == 2 * 3 * 2
    assert gaps(reference_a) <= 1e-12 and gaps(b) > 1e-2
    seen.clear()
    ro.old_log_probs = None
    actor.update(ro, _actor_cfg(ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.0, use_kl_loss=False),
                 num_mini_batches=1, kl_loss_coef=0.0, seed=0)
    assert len(seen) == 3 and gaps(b) <= 1e-12 and gaps(reference_a) > 1e-2


@pytest.mark.parametrize("family", [{}, QWEN2_MOE])
def test_a_forward_records_the_experts_it_replays_and_a_dense_model_has_none(family):
    """record_routing returns the experts each token ran through: its routers' choice, or the replayed ones, in
    models.moe.routing_dtype (uint8 here), k of them a sparse layer (a Qwen2-MoE's shared expert is not routed and not
    recorded); a model without sparse layers refuses to record."""
    model = Transformer.build(moe_args(**family), seed=0).double()
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, record = model(ids, record_routing=True)
        assert torch.equal(logits, model(ids)) and record.dtype == torch.uint8 and record.shape == (2, 7, 2, 2)
        assert torch.equal(record.long(), own_routing(model, ids))
        other = (record + 1) % 6
        _, replayed = model(ids, routed_experts=other, record_routing=True)
    assert torch.equal(replayed, other)
    dense = Transformer.build(moe_args(**family, mlp_only_layers=(0, 1, 2)), seed=0)
    with pytest.raises(ValueError, match=f"record_routing on a {dense.args.model_type} without sparse layers"):
        dense(ids, record_routing=True)


@pytest.mark.parametrize("family", [{}, QWEN2_MOE, GRANITE_MOE_SHARED])
def test_compiled_blocks_record_and_replay_as_eager_ones(family):
    """actor.use_torch_compile: blocks compiled in place (`sharding.compile.apply_compile`, aot_eager) return the
    record as eager blocks do (a second packed shape: no stale graph), and replaying it gives eager's logits (a
    Qwen2-MoE's shared expert in the compiled block too)."""
    from sharding.compile import apply_compile

    eager = Transformer.build(moe_args(**family), seed=0).double()
    compiled = Transformer.build(moe_args(**family), seed=0).double()
    apply_compile(compiled, backend="aot_eager")
    g = torch.Generator().manual_seed(6)
    for lengths in ([5, 9, 3], [7, 11]):
        ids = torch.randint(0, 96, (1, sum(lengths)), generator=g)
        cu = cu_seqlens_from_lengths(lengths)
        with torch.no_grad():
            want, record = eager(ids, cu_seqlens=cu, record_routing=True)
            got, again = compiled(ids, cu_seqlens=cu, record_routing=True)
            assert torch.equal(again, record) and torch.allclose(got, want, atol=1e-12, rtol=0)
            assert torch.allclose(compiled(ids, cu_seqlens=cu, routed_experts=record), want, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- config
def test_routing_replay_config_errors_name_the_keys(tmp_path):
    """R3 without the engine's record, R3 with multi-turn rollouts, the record with rollout.name=hf, the record or R2 on
    a dense model and R2 with rollout correction's bypass mode (no old-log-prob pass to record) are refused before any
    work, naming the keys; the record / replay files and the reference's replay are refused as unsupported; R3 with
    the record on a Qwen3-MoE passes the pre-flight, and so do the record alone (verl's: recorded, not replayed) and R2
    with or without it (R2 does not use it), with multi-turn rollouts and with the HF rollout."""
    from tests.unit.test_attention_window import _cfg
    from trainer.configlib import ConfigError
    from trainer.setup import preflight

    moe = tmp_path / "moe"
    Transformer.build(moe_args(), seed=0).save_pretrained(moe)
    dense = tmp_path / "dense"
    Transformer.build(ModelArgs(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
                      seed=0).save_pretrained(dense)
    record = "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    r3 = "actor_rollout_ref.actor.router_replay.mode=R3"
    cfg = _cfg(moe, 16, 32, record, r3)
    preflight(cfg, devices=False)
    preflight(_cfg(moe, 16, 32, record), devices=False)  # the record alone (verl's): recorded, not replayed
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.router_replay\.mode=R3 needs actor_rollout_ref"
                                          r"\.rollout\.enable_rollout_routing_replay=true"):
        preflight(_cfg(moe, 16, 32, r3), devices=False)
    with pytest.raises(ConfigError, match=r"router_replay\.mode=R3 with actor_rollout_ref\.rollout\.multi_turn\.enable="
                                          r"true is not supported"):
        preflight(_cfg(moe, 16, 32, record, r3, "actor_rollout_ref.rollout.multi_turn.enable=true"), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.enable_rollout_routing_replay=true needs "
                                          r"rollout\.name=native"):
        preflight(_cfg(moe, 16, 32, record, "actor_rollout_ref.rollout.name=hf"), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.rollout\.enable_rollout_routing_replay=true needs a "
                                          r"mixture-of-experts model: the llama in .*dense has no experts"):
        preflight(_cfg(dense, 16, 32, record), devices=False)
    r2 = "actor_rollout_ref.actor.router_replay.mode=R2"
    for extra in ((), (record,), ("actor_rollout_ref.rollout.multi_turn.enable=true",),
                  ("actor_rollout_ref.rollout.name=hf",)):
        preflight(_cfg(moe, 16, 32, r2, *extra), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.router_replay\.mode=R2 with algorithm\."
                                          r"rollout_correction\.bypass_mode=true: R2 replays the routing the actor's "
                                          r"old-log-prob pass records"):
        preflight(_cfg(moe, 16, 32, r2, "algorithm.rollout_correction.bypass_mode=true"), devices=False)
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.actor\.router_replay\.mode=R2 needs a "
                                          r"mixture-of-experts model: the llama in .*dense has no experts"):
        preflight(_cfg(dense, 16, 32, r2), devices=False)
    for key in ("actor_rollout_ref.ref.router_replay.mode=R3", "actor_rollout_ref.actor.router_replay.record_file=r.pt",
                "actor_rollout_ref.actor.router_replay.replay_file=r.pt"):
        with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')} is not supported by meshppo"):
            _cfg(moe, 16, 32, record, key)
