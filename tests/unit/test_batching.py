"""Batch splitting, and: packed / padded / dynamic micro-batches give the same update."""

import copy
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models import ModelArgs, Transformer
from trainer.batching import (balanced_equal_partitions, balanced_partitions, seqlen_workload,
                              token_budget_partitions)
from trainer.config import PolicyLossConfig
from trainer.forward import build_micro_batch, response_logprobs
from trainer.rollout_batch import RolloutBatch
from trainer.roles import Actor, Critic, MicroBatching, ReferencePolicy, RewardModel


def test_balanced_equal_partitions_sizes_and_balance():
    rng = random.Random(0)
    costs = [rng.randint(1, 100) for _ in range(64)]
    parts = balanced_equal_partitions(costs, 4)
    assert sorted(i for p in parts for i in p) == list(range(64))
    assert all(len(p) == 16 for p in parts)
    loads = [sum(costs[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs)
    assert loads == sorted(loads, reverse=True)  # the heaviest part first, as verl's
    with pytest.raises(ValueError, match="equal parts"):
        balanced_equal_partitions(costs[:63], 4)


def test_the_work_estimate_is_verls():
    # verl 0.9.1's calculate_workload: 24576 s + s² for s tokens (prompt + response)
    assert seqlen_workload([1, 10, 4096]) == [24577, 245_860, 117_440_512]


def test_balanced_equal_partitions_is_karmarkar_karp_by_hand():
    lengths = [9, 1, 4, 7, 5, 10]
    # By increasing cost, runs of 2: {1 (row 1), 4 (row 2)}, {5 (4), 7 (3)}, {9 (0), 10 (5)}, spreads of
    # 3, 2 and 1 tokens. The first two merge, heaviest with lightest: {4, 5} = 9 and {1, 7} = 8 (spread 1
    # token, and 16 + 25 - 1 - 49 = -9 in s², under the third's 1 token + 100 - 81). Then the third: {10, 1,
    # 7} = 18 and {9, 4, 5} = 18, the first heavier in s² (150 against 122): rank 0's.
    assert balanced_equal_partitions(seqlen_workload(lengths), 2) == [[1, 3, 5], [0, 2, 4]]
    # on the token counts alone the same merges; the tie 18 = 18 goes by the parts' first items, row 5's
    # (10) before row 0's (9). (Largest first to the lighter part gave 10 + 5 + 4 = 19 and 9 + 7 + 1 = 17.)
    assert balanced_equal_partitions(lengths, 2) == [[1, 3, 5], [0, 2, 4]]
    # one run of 3 items: each its own part, heaviest first
    assert balanced_equal_partitions([4, 9, 1], 3) == [[1], [0], [2]]
    assert balanced_equal_partitions([], 2) == [[], []]


def test_balanced_partitions_is_karmarkar_karp_by_hand():
    # verl 0.9.1's get_seqlen_balanced_partitions(equal_size=False). One state a row, by increasing cost:
    # 1 (row 1), 4 (2), 5 (4), 7 (3), 9 (0), 10 (5), each {x} {} of spread x. {10} and {9} merge first:
    # {10} {9}, spread 1; then {7} and {5}: {7} {5}, spread 2; then {4} with it: {4, 5} = 9 and {7}, spread
    # 2; then that with {10} {9} (spread 1 ties {1}'s, its heaviest part the heavier): {4, 5, 9} = 18 and
    # {7, 10} = 17; last {1}: {4, 5, 9} and {7, 10, 1}, 18 each, of 3 items each, ordered by first item:
    # row 3's (7) before row 2's (4).
    assert balanced_partitions([9, 1, 4, 7, 5, 10], 2) == [[1, 3, 5], [0, 2, 4]]
    # more parts than items (verl refuses it; meshppo's rank holding fewer rows): each item alone, heaviest
    # first, then the empty parts
    assert balanced_partitions([5, 3], 4) == [[0], [1], [], []]
    assert balanced_partitions([], 2) == [[], []]


def test_token_budget_partitions_are_verls_micro_batches():
    """The parts verl 0.9.1's rearrange_micro_batches gives on one rank (run outside the repo on these
    lengths; derived here by the rules)."""
    lengths = [17, 12, 17, 18, 6, 15, 14]
    # 99 tokens: ceil(99 / 34) = 3 parts first, whose balance of the work puts rows 0, 1 and 4 (35 tokens)
    # together: over the budget, so 4 parts, [0, 1] 29 tokens, [5, 6] 29, [2, 4] 23, [3] 18, of work
    # 713137 > 713125 > 565573 > 442692; ordered: the 1st and 3rd heaviest reversed, then the 2nd and 4th.
    # (meshppo's first-fit decreasing count was 3, and its token balance [3, 5] [0, 2] [1, 4, 6].)
    assert balanced_partitions(seqlen_workload(lengths), 3) == [[0, 1, 4], [3, 6], [2, 5]]
    assert token_budget_partitions([lengths], [seqlen_workload(lengths)], 34) == [[[2, 4], [0, 1], [5, 6], [3]]]
    # 35 tokens, 4 parts at once, [1] 221265 > [3, 4] 221237 > [0, 2, 6] 221219 > [5] 196672
    lengths = [5, 9, 3, 7, 2, 8, 1]
    assert token_budget_partitions([lengths], [seqlen_workload(lengths)], 10) == [[[0, 2, 6], [1], [3, 4], [5]]]
    # several batches at once, each its own; a batch without items gets one empty part
    assert token_budget_partitions([[4, 4], [], [3]], [[2, 1], [], [5]], 8) == [[[0, 1]], [[]], [[0]]]


def test_token_budget_partitions_keep_a_row_above_the_budget_alone():
    # verl stops at a row above the budget; meshppo runs it as a micro-batch of its own and keeps the budget
    # for the rest: 40 tokens give 4 parts, the 30-token row alone
    lengths = [30, 2, 3, 1, 4]
    parts = token_budget_partitions([lengths], [seqlen_workload(lengths)], 10)[0]
    assert len(parts) == 4 and [0] in parts
    assert sorted(i for p in parts for i in p) == list(range(5))
    assert all(sum(lengths[i] for i in p) <= 10 for p in parts if p != [0])


@pytest.mark.parametrize("seed", range(2))
def test_token_budget_partitions_count_budget_and_order_rules(seed):
    rng = random.Random(seed)
    for _ in range(200):
        budget = rng.randint(8, 64)
        tokens = [rng.randint(1, budget + budget // 4) for _ in range(rng.randint(1, 30))]
        work = seqlen_workload(tokens)
        parts = token_budget_partitions([tokens], [work], budget)[0]
        assert sorted(i for p in parts for i in p) == list(range(len(tokens)))
        assert all(len(p) == 1 or sum(tokens[i] for i in p) <= budget for p in parts), (tokens, budget, parts)

        def fits(k):
            return all(len(p) <= 1 or sum(tokens[i] for i in p) <= budget for p in balanced_partitions(work, k))

        # the count: the first from min(rows, ceil(tokens / budget)) up whose balanced parts fit
        first = min(len(tokens), -(-sum(tokens) // budget))
        assert len(parts) >= first and fits(len(parts))
        assert not any(fits(k) for k in range(first, len(parts)))
        assert sorted(parts) == sorted(balanced_partitions(work, len(parts)))
        # the order: by work heaviest first, the even places reversed and then the odd ones
        loads = [sum(work[i] for i in p) for p in parts]
        heaviest = sorted(loads, reverse=True)
        assert loads == heaviest[::2][::-1] + heaviest[1::2]


def _rollouts(n=8, seed=0, vocab=41):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    responses = [torch.randint(0, vocab, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(n)]
    width = max(len(r) for r in responses)
    ro = RolloutBatch(prompts, responses, list(range(n)), [None] * n, [None] * n, [{}] * n, ["stop"] * n,
                      [[0.0] * len(r) for r in responses], width, torch.device("cpu"))
    mask = ro.response_mask
    ro.advantages = torch.randn(n, width, generator=g) * mask
    ro.ref_log_probs = -torch.rand(n, width, generator=g) * mask
    return ro


def test_response_mask_marks_each_response_and_travels_with_take():
    ro = RolloutBatch([[1], [2, 3], [4]], [[5, 6, 7], [8], []], [0, 1, 2], [None] * 3, [None] * 3, [{}] * 3,
                      ["stop"] * 3, [[0.0] * 3, [0.0], []], 4, torch.device("cpu"))
    want = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    assert ro.response_mask.dtype == torch.float32 and torch.equal(ro.response_mask, want)
    assert ro.host_response_mask().dtype == np.float32 and np.array_equal(ro.host_response_mask(), want.numpy())
    assert torch.equal(ro.take([2, 0]).response_mask, want[[2, 0]])
    lp = ro.padded([[-0.5, -1.0, -2.0], [-3.0], []])
    assert torch.equal(lp, torch.tensor([[-0.5, -1.0, -2.0, 0.0], [-3.0, 0, 0, 0], [0, 0, 0, 0]]))


def _actor_cfg(**kw):
    base = dict(ppo_epochs=1, shuffle=False, loss_agg_mode="token-mean", ppo_micro_batch_size_per_gpu=2,
                use_dynamic_bsz=False, ppo_max_token_len_per_gpu=12, entropy_coeff=0.01, use_kl_loss=True,
                kl_loss_type="low_var_kl", clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None,
                clip_ratio_c=3.0, grad_clip=1e9, loss_scale_factor=None, policy_loss=PolicyLossConfig(), tau_pos=1.0,
                tau_neg=1.05, calculate_entropy=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_packed_and_padded_forward_agree():
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    model = Transformer.build(args, seed=0)
    ro = _rollouts()
    prompts, responses = ro.prompts, ro.responses
    with torch.no_grad():
        a, ea = response_logprobs(model, build_micro_batch(prompts, responses, "cpu", True), ro.width, 0.8, True)
        b, eb = response_logprobs(model, build_micro_batch(prompts, responses, "cpu", False), ro.width, 0.8, True)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-5)
    # padding positions are zero, real ones are log-probs (< 0)
    assert torch.all(a[ro.response_mask == 0] == 0) and torch.all(a[ro.response_mask == 1] < 0)


BATCHINGS = [MicroBatching(None, False, 0), MicroBatching(3, False, 0), MicroBatching(None, True, 12)]


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("batching", BATCHINGS)
def test_forward_roles_put_each_sequence_in_its_row(packed, batching):
    """The one forward loop (plan -> forward -> scatter) under every role: each row holds what a
    lone forward of that sequence gives, whatever the micro-batches and the layout."""
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    policy, value = Transformer.build(args, seed=0), Transformer.build(args, head="value", seed=1)
    ro = _rollouts(n=7)
    kw = dict(packed=packed, pad_token_id=0, device=torch.device("cpu"), batching=batching)
    with torch.no_grad():
        logp = ReferencePolicy(policy, temperature=0.7, **kw).log_probs(ro)
        values = Critic(value, None, None, world_size=1, response_length=5, **kw).values(ro)
        scores = RewardModel(value, **kw).scores(ro)
        for i, (p, r) in enumerate(zip(ro.prompts, ro.responses)):
            ids = torch.tensor([p + r])
            logits = policy(ids)[0].float() / 0.7
            lone_logp = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(-1, torch.tensor(r)[:, None])[:, 0]
            lone_values = value(ids)[0].float()
            assert torch.allclose(logp[i, :len(r)], lone_logp, atol=1e-5) and torch.all(logp[i, len(r):] == 0)
            assert torch.allclose(values[i, :len(r)], lone_values[len(p) - 1:-1], atol=1e-5)
            assert torch.all(values[i, len(r):] == 0)
            assert abs(float(scores[i]) - float(lone_values[-1])) < 1e-5


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_update_independent_of_packing_and_micro_batching(mode):
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    base = Transformer.build(args, seed=0)
    results = []
    for packed, micro, dynamic in [(True, 8, False), (False, 2, False), (True, None, True), (False, 4, False)]:
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        worker = Actor(model, opt, None, packed=packed, temperature=1.0, pad_token_id=0, device=torch.device("cpu"),
                       world_size=1, response_length=5, batching=MicroBatching(8, False, 0))
        ro = _rollouts()
        with torch.no_grad():
            old, _ = worker.log_probs(ro)
        ro.old_log_probs = old - 0.05 * ro.response_mask  # ratios != 1, some clipped
        worker.update(ro, _actor_cfg(loss_agg_mode=mode, ppo_micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic),
                      num_mini_batches=1, kl_loss_coef=0.1, seed=0)
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    ref = results[0]
    moved = max((ref[k] - base.state_dict()[k]).abs().max().item() for k in ref)
    assert moved > 1e-4  # the update did something
    for other in results[1:]:
        for k in ref:
            assert torch.allclose(ref[k], other[k], atol=2e-6), k


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_gradient_skips_the_step_on_device_and_on_host(fused):
    """Fused optimizers skip on a device flag (no host read per mini-batch), others on the host:
    either way a NaN gradient leaves the weights and Adam's step count untouched, and a finite
    one after it is applied."""
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    model = Transformer.build(args, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=not fused)
    worker = Actor(model, opt, None, packed=True, temperature=1.0, pad_token_id=0, device=torch.device("cpu"),
                   world_size=1, response_length=5, batching=MicroBatching(8, False, 0))
    ro = _rollouts()
    with torch.no_grad():
        old, _ = worker.log_probs(ro)
    ro.old_log_probs = old - 0.05 * ro.response_mask
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ro.advantages[0, 0] = float("nan")
    out = worker.update(ro, _actor_cfg(grad_clip=1.0), num_mini_batches=1, kl_loss_coef=0.1, seed=0)
    assert out["actor/nonfinite_skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(float(s["step"]) == 0 for s in opt.state.values())
    ro.advantages[0, 0] = 0.5
    out = worker.update(ro, _actor_cfg(grad_clip=1.0), num_mini_batches=2, kl_loss_coef=0.1, seed=0)
    assert out["actor/nonfinite_skipped"] == 0.0 and math.isfinite(out["actor/grad_norm"])
    assert not torch.equal(before["layers.0.mlp.up_proj.weight"], model.state_dict()["layers.0.mlp.up_proj.weight"])
    assert all(float(s["step"]) == 2 for s in opt.state.values())


def test_packed_layout_matches_a_per_sequence_reference():
    """Every field of the packed micro-batch against a loop over sequences written out here:
    sequences laid end to end, each token's label the next token of the same sequence (the pad
    after its last), positions restarting at 0, and the position before each response token
    mapped to its (row, column)."""
    rng = random.Random(3)
    for _ in range(60):
        n = rng.randint(1, 7)
        prompts = [[rng.randint(1, 50) for _ in range(rng.randint(1, 9))] for _ in range(n)]
        responses = [[rng.randint(1, 50) for _ in range(rng.randint(0, 6))] for _ in range(n)]
        ids, labels, pos, cu, src, rows, cols, last = [], [], [], [0], [], [], [], []
        for b, (p, r) in enumerate(zip(prompts, responses)):
            s = p + r
            off = len(ids)
            ids += s
            labels += s[1:] + [5]
            pos += list(range(len(s)))
            cu.append(off + len(s))
            for j in range(len(r)):
                src.append(off + len(p) - 1 + j)
                rows.append(b)
                cols.append(j)
            last.append(off + len(s) - 1)
        mb = build_micro_batch(prompts, responses, "cpu", True, pad_token_id=5)
        assert mb.input_ids.tolist() == [ids] and mb.labels.tolist() == [labels] and mb.position_ids.tolist() == [pos]
        assert mb.cu_seqlens.dtype == torch.int32 and mb.cu_seqlens.tolist() == cu
        assert (mb.src_index.tolist(), mb.dst_row.tolist(), mb.dst_col.tolist()) == (src, rows, cols)
        assert mb.last_index.tolist() == last and mb.attention_mask is None
        assert mb.max_seqlen == max(len(p) + len(r) for p, r in zip(prompts, responses)) and mb.batch_size == n
    # a rank without sequences still lays out one pad token (its forward keeps collectives in step)
    empty = build_micro_batch([], [], "cpu", True, pad_token_id=5)
    assert empty.input_ids.tolist() == [[5]] and empty.src_index.numel() == 0 and empty.batch_size == 1


def test_padded_layout_matches_a_per_sequence_reference():
    """Every field of the padded micro-batch against a loop over sequences written out here:
    prompts left-padded to the longest prompt, responses right-padded after them, each row's
    label the token one column to the right (wrapping), positions counting real tokens from 0
    (0 on the left padding), and the column before each response token mapped to its (row, column)."""
    rng = random.Random(4)
    for _ in range(60):
        n = rng.randint(1, 7)
        prompts = [[rng.randint(1, 50) for _ in range(rng.randint(1, 9))] for _ in range(n)]
        responses = [[rng.randint(1, 50) for _ in range(rng.randint(0, 6))] for _ in range(n)]
        max_p, max_r = max(map(len, prompts)), max(map(len, responses))
        width = max_p + max_r
        ids, mask, pos, src, rows, cols, last = [], [], [], [], [], [], []
        for b, (p, r) in enumerate(zip(prompts, responses)):
            left = max_p - len(p)
            row = [5] * left + p + r + [5] * (max_r - len(r))
            ids.append(row)
            mask.append([0] * left + [1] * (len(p) + len(r)) + [0] * (max_r - len(r)))
            pos.append([0] * left + list(range(len(p) + len(r))) + [len(p) + len(r) - 1] * (max_r - len(r)))
            for j in range(len(r)):
                src.append(b * width + max_p - 1 + j)
                rows.append(b)
                cols.append(j)
            last.append(b * width + max_p + len(r) - 1)
        mb = build_micro_batch(prompts, responses, "cpu", False, pad_token_id=5)
        assert mb.input_ids.tolist() == ids and mb.attention_mask.tolist() == mask and mb.position_ids.tolist() == pos
        assert mb.labels.tolist() == [row[1:] + row[:1] for row in ids]
        assert (mb.src_index.tolist(), mb.dst_row.tolist(), mb.dst_col.tolist()) == (src, rows, cols)
        assert mb.last_index.tolist() == last and mb.cu_seqlens is None and mb.max_seqlen is None
        assert mb.batch_size == n and mb.input_ids.dtype == torch.long


def test_loss_scale_factor_is_the_constant_divisor_of_seq_mean_token_sum_norm():
    """`actor.loss_scale_factor` (verl's option; null: the response length) is T in
    sum_i (sum_t L_i,t / T) / N_seqs. At the first mini-batch the ratio is 1, so pg_loss is
    -sum(A) / (T * 8) for the 8 rows, and an SGD step with T = 20 is a quarter of the step
    with T = response length 5 (no KL or entropy term)."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config

    cfg = load_config(PPOConfig, None, ["actor_rollout_ref.actor.loss_scale_factor=20"]).actor_rollout_ref.actor
    assert cfg.loss_scale_factor == 20
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    base = Transformer.build(args, seed=0)
    deltas = {}
    for factor in (None, 20):
        model = copy.deepcopy(base)
        worker = Actor(model, torch.optim.SGD(model.parameters(), lr=1.0), None, packed=True, temperature=1.0,
                       pad_token_id=0, device=torch.device("cpu"), world_size=1, response_length=5,
                       batching=MicroBatching(8, False, 0))
        ro = _rollouts()
        with torch.no_grad():
            ro.old_log_probs, _ = worker.log_probs(ro)
        out = worker.update(ro, _actor_cfg(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=factor,
                                           entropy_coeff=0.0, use_kl_loss=False),
                            num_mini_batches=1, kl_loss_coef=0.0, seed=0)
        t = 5 if factor is None else factor
        assert out["actor/pg_loss"] == pytest.approx(-float(ro.advantages.double().sum()) / (t * 8), rel=1e-6)
        deltas[factor] = {k: v - base.state_dict()[k] for k, v in model.state_dict().items()}
    assert max(v.abs().max().item() for v in deltas[None].values()) > 1e-4
    for k, v in deltas[None].items():
        torch.testing.assert_close(deltas[20][k], v / 4, rtol=0, atol=1e-7, msg=k)


def _actor_and_critic(lr=0.0):
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    model, value = Transformer.build(args, seed=0), Transformer.build(args, head="value", seed=1)
    common = dict(packed=True, pad_token_id=0, device=torch.device("cpu"), world_size=1, response_length=5,
                  batching=MicroBatching(8, False, 0))
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=lr), None, temperature=1.0, **common)
    critic = Critic(value, torch.optim.SGD(value.parameters(), lr=lr), None, **common)
    return actor, critic


def _critic_cfg(**kw):
    return SimpleNamespace(**{**dict(ppo_epochs=1, shuffle=False, loss_agg_mode="token-mean",
                                     ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                                     ppo_max_token_len_per_gpu=12, grad_clip=1e9, cliprange_value=0.5,
                                     loss_scale_factor=None), **kw})


LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "critic/vf_loss")


def _two_mini_batches_at_lr_0():
    """An actor and critic, rollouts with their old log-probs, values and returns, the old pass's
    per-token entropy, and `mean_of_halves`: the mean of the two mini-batches' (rows 0-3, 4-7) token
    means of a per-token figure, what a loss metric is with lr 0 (nothing moves)."""
    actor, critic = _actor_and_critic()
    ro = _rollouts()
    with torch.no_grad():
        ro.old_log_probs, entropy = actor.log_probs(ro, with_entropy=True)
        ro.values = critic.values(ro)
    mask = ro.response_mask.double()
    ro.returns = ro.values + torch.linspace(-1, 1, ro.width) * ro.response_mask
    halves = (slice(0, 4), slice(4, 8))

    def mean_of_halves(per_token):
        return sum(float((per_token[h] * mask[h]).sum() / mask[h].sum()) for h in halves) / 2

    return actor, critic, ro, entropy, mean_of_halves


def test_update_losses_are_the_mean_over_mini_batches_and_epochs_as_verls():
    """verl 0.9.1's engine workers report `actor/pg_loss`, `actor/kl_loss`, `actor/entropy_loss` and
    `critic/vf_loss` as the mean over the mini-batches of every epoch of each mini-batch's
    global-mean loss (`train_mini_batch`, then `reduce_metrics`' mean); the statistics stay means.
    With lr 0 nothing moves, so with 2 epochs x 2 mini-batches (rows 0-3, 4-7) each loss is the
    mean of the two mini-batches' token means, computed here by hand."""
    from kl import kl_penalty

    actor, critic, ro, entropy, mean_of_halves = _two_mini_batches_at_lr_0()

    out = actor.update(ro, _actor_cfg(ppo_epochs=2), num_mini_batches=2, kl_loss_coef=0.1, seed=0)
    kl = kl_penalty(ro.old_log_probs.double(), ro.ref_log_probs.double(), "low_var_kl")
    assert out["actor/pg_loss"] == pytest.approx(mean_of_halves(-ro.advantages.double()), rel=1e-5)
    assert out["actor/kl_loss"] == pytest.approx(mean_of_halves(kl), rel=1e-5)
    assert out["actor/entropy_loss"] == pytest.approx(mean_of_halves(entropy.double()), rel=1e-5)
    assert out["actor/pg_clipfrac"] == 0.0  # a mean, not a sum
    out = critic.update(ro, _critic_cfg(ppo_epochs=2), num_mini_batches=2, seed=0)
    assert out["critic/vf_loss"] == pytest.approx(mean_of_halves(0.5 * (ro.returns - ro.values).double() ** 2),
                                                  rel=1e-5)
    # verl's critic/vpred_mean: the mean over micro-batches (here the two mini-batches) of each one's mean value
    # over its response tokens
    out = critic.update(ro, _critic_cfg(ppo_epochs=2, ppo_micro_batch_size_per_gpu=4), num_mini_batches=2, seed=0)
    assert out["critic/vpred_mean"] == pytest.approx(mean_of_halves(ro.values.double()), rel=1e-5)
    # a count of the skipped optimizer steps, as the actor's (it was their share: 0.5 here): the first
    # mini-batch's non-finite returns skip it in both epochs
    ro.returns[0, 0] = float("nan")
    out = critic.update(ro, _critic_cfg(ppo_epochs=2), num_mini_batches=2, seed=0)
    assert out["critic/nonfinite_skipped"] == 2.0


@pytest.mark.parametrize("entropy_coeff,calculate_entropy", [(0.0, False), (0.0, True), (0.01, False), (0.01, True)])
def test_update_entropy_and_total_loss_as_verls(entropy_coeff, calculate_entropy):
    """verl 0.9.1: `actor/entropy` is the old-log-prob pass's (the trainer's); the update never
    replaces it (meshppo did with calculate_entropy or an entropy bonus). The update's own entropy
    is `actor/entropy_loss`, logged whenever verl computes it (calculate_entropy or entropy_coeff
    != 0: also with a coefficient of 0, where meshppo logged none). `actor/loss` and `critic/loss`
    are each mini-batch's whole loss (pg - entropy_coeff * entropy + kl_coef * kl; the value
    loss), averaged over mini-batches and epochs as its terms. lr 0, 2 epochs x 2 mini-batches."""
    from kl import kl_penalty

    actor, critic, ro, entropy, mean_of_halves = _two_mini_batches_at_lr_0()

    pg = mean_of_halves(-ro.advantages.double())
    kl = mean_of_halves(kl_penalty(ro.old_log_probs.double(), ro.ref_log_probs.double(), "low_var_kl"))
    ent = mean_of_halves(entropy.double())
    cfg = _actor_cfg(ppo_epochs=2, entropy_coeff=entropy_coeff, calculate_entropy=calculate_entropy)
    out = actor.update(ro, cfg, num_mini_batches=2, kl_loss_coef=0.1, seed=0)
    assert "actor/entropy" not in out
    if entropy_coeff or calculate_entropy:
        assert out["actor/entropy_loss"] == pytest.approx(ent, rel=1e-5)
    else:
        assert "actor/entropy_loss" not in out
    assert out["actor/loss"] == pytest.approx(pg - entropy_coeff * ent + 0.1 * kl, rel=1e-5)
    out = critic.update(ro, _critic_cfg(ppo_epochs=2), num_mini_batches=2, seed=0)
    vf = mean_of_halves(0.5 * (ro.returns - ro.values).double() ** 2)
    assert out["critic/loss"] == pytest.approx(vf, rel=1e-5) and out["critic/vf_loss"] == out["critic/loss"]


def test_update_losses_do_not_grow_with_mini_batches_or_epochs():
    """Every token's loss term the same constant (A = 0.7 at ratio 1; the reference 0.3 nats above
    the actor, so low_var_kl's e^0.3 - 0.3 - 1; returns 0.4 above the values, so 0.5 * 0.16): each
    loss is that constant whichever split, 1 or 4 mini-batches, 1 or 2 epochs (lr 0). Summed
    over the mini-batches and epochs, as before, they were 2, 4 or 8 times it."""
    actor, critic = _actor_and_critic()
    ro = _rollouts()
    with torch.no_grad():
        ro.old_log_probs, _ = actor.log_probs(ro)
        ro.values = critic.values(ro)
    mask = ro.response_mask
    ro.advantages = 0.7 * mask
    ro.ref_log_probs = (ro.old_log_probs + 0.3) * mask
    ro.returns = ro.values + 0.4 * mask
    with torch.no_grad():  # the entropy term has no constant: its own value at the whole batch, by hand
        _, entropy = actor.log_probs(ro, with_entropy=True)
    want = {"actor/pg_loss": -0.7, "actor/kl_loss": math.exp(0.3) - 0.3 - 1, "critic/vf_loss": 0.5 * 0.4 ** 2}
    seen = {}
    for minis in (1, 4):
        for epochs in (1, 2):
            out = actor.update(ro, _actor_cfg(ppo_epochs=epochs), num_mini_batches=minis, kl_loss_coef=0.1, seed=0)
            out.update(critic.update(ro, _critic_cfg(ppo_epochs=epochs), num_mini_batches=minis, seed=0))
            for key, value in want.items():
                assert out[key] == pytest.approx(value, rel=1e-5), (key, minis, epochs)
            seen[minis, epochs] = out["actor/entropy_loss"]
    # the entropy: the mean of each mini-batch's token mean, the same at 1 and 2 epochs
    token_mean = lambda rows: float((entropy[rows] * mask[rows]).sum() / mask[rows].sum())  # noqa: E731
    assert seen[1, 1] == pytest.approx(token_mean(slice(0, 8)), rel=1e-5)
    assert seen[4, 1] == pytest.approx(sum(token_mean(slice(i, i + 2)) for i in range(0, 8, 2)) / 4, rel=1e-5)
    for minis in (1, 4):
        assert seen[minis, 2] == pytest.approx(seen[minis, 1], rel=1e-5)


def test_critic_loss_scale_factor_divides_its_seq_mean_token_sum_norm():
    """critic.loss_scale_factor (verl's, null: the actor's) is T of the value loss's
    seq-mean-token-sum-norm: 0.5 sum_i (sum_t (R - V)^2 / T) / N_seqs; null: the response length 5
    (it was always the response length). lr 0: the values are the ones computed before."""
    from trainer.config import PPOConfig
    from trainer.configlib import load_config

    cfg = load_config(PPOConfig, None, ["actor_rollout_ref.actor.loss_scale_factor=20"])
    assert cfg.critic.loss_scale_factor == 20  # the actor's, as verl's ${oc.select:...actor.loss_scale_factor}
    cfg = load_config(PPOConfig, None, ["actor_rollout_ref.actor.loss_scale_factor=20", "critic.loss_scale_factor=7"])
    assert (cfg.critic.loss_scale_factor, cfg.actor_rollout_ref.actor.loss_scale_factor) == (7, 20)
    _, critic = _actor_and_critic()
    ro = _rollouts()
    with torch.no_grad():
        ro.values = critic.values(ro)
    ro.returns = ro.values + torch.linspace(-1, 1, ro.width) * ro.response_mask
    squares = float(((ro.returns - ro.values).double() ** 2 * ro.response_mask).sum())
    for factor, t in ((None, 5), (20, 20)):
        out = critic.update(ro, _critic_cfg(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=factor),
                            num_mini_batches=1, seed=0)
        assert out["critic/vf_loss"] == pytest.approx(0.5 * squares / t / 8, rel=1e-5)


def test_critic_vpred_mean_leaves_out_rejected_tokens():
    """With rollout rejection, verl's critic reads the batch's response_mask after the rejection
    mask overwrote it: critic/vpred_mean, like vf_loss, is the mean value over the kept tokens
    (`loss_mask`). Here the rejected tokens are the first three of every response, so the mean
    over every response token differs from it; lr 0, one micro-batch: the model's values are the
    ones computed before the update."""
    args = ModelArgs(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    value = Transformer.build(args, head="value", seed=1)
    critic = Critic(value, torch.optim.SGD(value.parameters(), lr=0.0), None, packed=True, pad_token_id=0,
                    device=torch.device("cpu"), world_size=1, response_length=5, batching=MicroBatching(8, False, 0))
    ro = _rollouts()
    with torch.no_grad():
        ro.values = critic.values(ro)
    mask = ro.response_mask
    # rejected: the first three tokens of every response; rows of one token keep it (none is left empty)
    keep = mask.clone()
    keep[:, :3] = 0
    keep[mask.sum(-1) <= 3, 0] = 1
    keep *= mask
    ro.rollout_rs_mask = keep
    ro.returns = ro.values.clone()
    out = critic.update(ro, _critic_cfg(ppo_micro_batch_size_per_gpu=8), num_mini_batches=1, seed=0)
    v, k, m = ro.values.double(), keep.double(), mask.double()
    kept = float((v * k).sum() / k.sum())
    every = float((v * m).sum() / m.sum())
    assert abs(kept - every) > 100 * 1e-5 * abs(kept)  # the two means differ far beyond the tolerance
    assert out["critic/vpred_mean"] == pytest.approx(kept, rel=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_micro_batch_from_flat_rows_reads_no_row_as_a_list(monkeypatch, packed):
    """`build_micro_batch` lays out a batch's `Ragged` rows from their flat arrays: the same tokens as
    each row's prompt then response (packed: end to end; padded: the prompt left-padded), the response
    tokens as labels, and no row turned into a Python list on the way (a per-row loop over 100k
    tokens cost more than the layout itself)."""
    from trainer.batching import Ragged
    from trainer.forward import build_micro_batch

    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 50, size=k).tolist() for k in (3, 1, 4)]
    responses = [rng.integers(1, 50, size=k).tolist() for k in (2, 0, 3)]
    flat_p, flat_r = Ragged.of(prompts, np.int32), Ragged.of(responses, np.int32)

    def no_rows(*_):
        raise AssertionError("a row read as a list")

    monkeypatch.setattr(Ragged, "__iter__", no_rows)
    monkeypatch.setattr(Ragged, "__getitem__", no_rows)
    mb = build_micro_batch(flat_p, flat_r, torch.device("cpu"), packed, pad_token_id=0)
    monkeypatch.undo()
    if packed:
        assert mb.input_ids[0].tolist() == [t for p, r in zip(prompts, responses) for t in p + r]
    else:
        width = max(len(p) for p in prompts) + max(len(r) for r in responses)
        for row, (p, r) in zip(mb.input_ids.tolist(), zip(prompts, responses)):
            assert row[max(len(q) for q in prompts) - len(p):][:len(p) + len(r)] == p + r and len(row) == width
    assert mb.src_labels.tolist() == [t for r in responses for t in r]
    assert mb.work[:2] == (sum(map(len, prompts)) + sum(map(len, responses)), sum(map(len, responses)))


def test_verl_md_says_how_verls_critic_picks_its_micro_batches():
    """verl 0.9.1's critic engine never gets critic.use_dynamic_bsz (its engine default, true, stays), the
    micro-batch sizes or forward_max_token_len_per_gpu, and runs under ppo_infer_max_token_len_per_gpu, an
    option meshppo refuses naming it; meshppo honours the five. VERL.md's micro-batch paragraph says so."""
    import os

    from trainer.config import PPOConfig
    from trainer.configlib import ConfigError, load_config

    with pytest.raises(ConfigError, match="critic.ppo_infer_max_token_len_per_gpu"):
        load_config(PPOConfig, None, ["+critic.ppo_infer_max_token_len_per_gpu=1024"])
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "..", "..", "docs", "VERL.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    start = text.index("meshppo's critic takes its micro-batches")
    paragraph = text[start:text.index("Where a figure under verl's name", start)]
    for name in ("critic.use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_max_token_len_per_gpu",
                 "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu",
                 "critic.ppo_infer_max_token_len_per_gpu", "use_v1=true"):
        assert f"`{name}`" in paragraph, name
