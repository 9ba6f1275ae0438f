"""Prefix sharing (`actor.use_prefix_grouper`): the responses of one prompt laid out after a single
copy of it give what `prompt + response` rows give, in float64, with fewer tokens run."""

import os

import numpy as np
import pytest
import torch

from models import ModelArgs, Transformer
from models.attention import attention_packed, block_causal_mask
from trainer.batching import balanced_group_partitions, prompt_groups, shared_prefix_items
from trainer.config import PPOConfig, validate
from trainer.configlib import ConfigError, load_config
from trainer.forward import build_micro_batch, last_token_scores, response_logprobs, response_values

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
A = "actor_rollout_ref.actor"

ARGS = ModelArgs(vocab_size=53, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, attention_bias=True, tie_word_embeddings=True)


def _rows(seed=0):
    """Three prompts: one with three responses (one of them empty), one alone, one with two; the
    rows interleaved, so that a group's rows are not neighbours."""
    g = torch.Generator().manual_seed(seed)
    tok = lambda n: torch.randint(1, ARGS.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    a, b, c = tok(7), tok(4), tok(9)
    prompts = [a, b, a, c, a, c]
    responses = [tok(5), tok(6), tok(3), tok(8), [], tok(1)]
    return prompts, responses


def test_layout_by_hand():
    prompts = [[11, 12, 13], [21, 22], [11, 12, 13]]
    responses = [[1, 2], [3], [4, 5, 6]]
    mb = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=True)
    # emitted: prompt a, response 0, response 2 (its group), then row 1 alone
    assert mb.input_ids.tolist() == [[11, 12, 13, 1, 2, 4, 5, 6, 21, 22, 3]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2]]
    assert mb.cu_seqlens.tolist() == [0, 3, 5, 8, 11]
    assert mb.max_seqlen == 3
    # keys: the prompt; the prompt then response 0; the prompt then response 2; row 1
    assert mb.shared.kv_index.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 5, 6, 7, 8, 9, 10]
    assert mb.shared.cu_seqlens_k.tolist() == [0, 3, 8, 14, 17]
    assert mb.shared.max_seqlen_k == 6
    # each response token and the position that predicts it (the prompt's last for a first token)
    got = sorted(zip(mb.dst_row.tolist(), mb.dst_col.tolist(), mb.src_index.tolist(), mb.src_labels.tolist()))
    assert got == [(0, 0, 2, 1), (0, 1, 3, 2), (1, 0, 9, 3), (2, 0, 2, 4), (2, 1, 5, 5), (2, 2, 6, 6)]
    assert mb.src_index.tolist() == sorted(mb.src_index.tolist())  # position order (Ulysses' gather)
    assert sorted(zip(mb.last_rows.tolist(), mb.last_index.tolist())) == [(0, 4), (1, 10), (2, 7)]
    # tokens run, positions scored, attention pairs: prompt 3²/2, responses 2·3 + 2²/2 and 3·3 + 3²/2, row 1 3²/2
    assert mb.work == (11, 6, 4.5 + 8 + 13.5 + 4.5)
    plain = build_micro_batch(prompts, responses, "cpu", packed=True)
    assert plain.shared is None and plain.work == (14, 6, (25 + 9 + 36) / 2)


def test_no_repeated_prompt_is_the_plain_layout():
    prompts, responses = [[1, 2], [3, 4, 5]], [[6], [7, 8]]
    shared = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=True)
    plain = build_micro_batch(prompts, responses, "cpu", packed=True)
    assert shared.shared is None and shared.last_rows is None
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "src_index", "src_labels", "dst_row",
                 "dst_col", "last_index"):
        assert torch.equal(getattr(shared, name), getattr(plain, name)), name


def test_mask_with_keys_apart_from_queries_by_hand():
    # segment 0: 2 queries over 2 keys; segment 1: 2 queries over 5 keys (a 3-token prefix first)
    mask = block_causal_mask(torch.tensor([0, 2, 4]), 4, torch.tensor([0, 2, 7]), 7)
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0, 0],
                                   [1, 1, 0, 0, 0, 0, 0],
                                   [0, 0, 1, 1, 1, 1, 0],
                                   [0, 0, 1, 1, 1, 1, 1]]
    same = block_causal_mask(torch.tensor([0, 2, 5]), 6)  # keys = queries; the trailing token alone
    assert same.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0],
                                   [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


def test_shared_attention_equals_each_sequence_whole():
    """A response's attention output over the shared prompt's keys equals its tokens' output in the
    plain `prompt + response` sequence (float64)."""
    g = torch.Generator().manual_seed(1)
    prompts, responses = [[1] * 5, [1] * 5], [[2] * 3, [3] * 4]
    mb = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=True)
    plain = build_micro_batch(prompts, responses, "cpu", packed=True)
    # the prompt's, response 0's and response 1's queries, keys and values (5, 3 and 4 tokens)
    qkv = [torch.randn(12, h, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2)]
    plain_rows = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 8, 9, 10, 11])  # prompt twice
    out_plain = attention_packed(*(t[plain_rows] for t in qkv), plain.cu_seqlens, plain.max_seqlen, 0.3)
    out_shared = attention_packed(*qkv, mb.cu_seqlens, mb.max_seqlen, 0.3, mb.shared)
    assert torch.allclose(out_shared[:8], out_plain[:8], rtol=0, atol=1e-13)
    assert torch.allclose(out_shared[8:], out_plain[13:], rtol=0, atol=1e-13)
    assert not torch.allclose(out_shared[8:], attention_packed(*qkv, mb.cu_seqlens, mb.max_seqlen, 0.3)[8:])


def _weights(rows, cols):
    return torch.sin(1.0 + rows.double() * 0.7 + cols.double() * 0.3)


def _run(head, share, outputs):
    """`outputs(model, mb, width) -> [.., B, R]` of the float64 model and the parameter gradients of a
    weighted sum of them, and the tokens the micro-batch ran."""
    prompts, responses = _rows()
    width = max(map(len, responses))
    model = Transformer.build(ARGS, head=head, seed=0, dtype=torch.float64)
    mb = build_micro_batch(prompts, responses, "cpu", packed=True, share_prefix=share)
    out = outputs(model, mb, width)
    r = torch.arange(len(prompts))[:, None].expand(-1, width)
    c = torch.arange(width)[None].expand(len(prompts), -1)
    (out * _weights(r, c)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, mb.work[0]


def _hidden_at_scored(model, mb, width):
    """The final hidden states at the scored positions, projected on a fixed direction, placed in
    `[B, R]` (float64 up to the norms; the LM head computes in float32)."""
    h = model.hidden_states(mb.input_ids, **mb.model_kwargs()).reshape(-1, ARGS.hidden_size)
    proj = h[mb.src_index] @ torch.cos(torch.arange(ARGS.hidden_size, dtype=torch.float64))
    return proj.new_zeros(len(_rows()[0]), width).index_put((mb.dst_row, mb.dst_col), proj)


def _trainer_lm(model, mb, width):
    return torch.stack(response_logprobs(model, mb, width, temperature=0.7, with_entropy=True))


def _trainer_value(model, mb, width):
    return torch.stack([response_values(model, mb, width), last_token_scores(model, mb)[:, None].expand(-1, width)])


@pytest.mark.parametrize("head, outputs", [("lm", _hidden_at_scored), ("lm", _trainer_lm),
                                           ("value", _trainer_value)])
def test_forward_and_gradients_equal_the_plain_layout(head, outputs):
    """Outputs equal (each position computes what it computes in its own sequence); gradients equal
    up to rounding: RMSNorm normalises in float32 (as Hugging Face's), and a shared prompt's
    gradient is summed over its responses before the norms' backward, where the plain layout sums
    after it (measured ≤ 2.6e-7 of each parameter's largest gradient; a wrong position, mask or
    gradient path moves them by O(1))."""
    (plain, plain_grads, plain_tokens), (shared, shared_grads, shared_tokens) = (
        _run(head, share, outputs) for share in (False, True))
    assert shared_tokens == plain_tokens - 2 * 7 - 9  # the repeated prompts run once
    assert torch.allclose(shared, plain, rtol=0, atol=1e-12 * plain.abs().max())
    for n, g in plain_grads.items():
        assert torch.allclose(shared_grads[n], g, rtol=0, atol=1e-5 * g.abs().max()), n


def test_padded_layout_refuses_sharing():
    with pytest.raises(ValueError, match="prefix sharing needs the packed layout"):
        build_micro_batch([[1]], [[2]], "cpu", packed=False, share_prefix=True)


def test_prompt_groups_and_items():
    prompts = [[1, 2], [3], [1, 2], [], [], [3], [1, 2]]
    leaders = prompt_groups(prompts)
    assert leaders.tolist() == [0, 1, 0, 3, 4, 1, 0]  # empty prompts share nothing
    lp = [len(p) for p in prompts]
    lr = [4, 2, 3, 1, 1, 5, 4]
    items, costs = shared_prefix_items(list(range(7)), leaders, lp, lr, max_tokens=9)
    # group 0: 2 + 4 + 3 = 9 fits, row 6 starts a new item (2 + 4); group 1: 1 + 2 + 5
    assert items == [[0, 2], [1, 5], [3], [4], [6]]
    assert costs == [9, 8, 1, 1, 6]
    over, over_costs = shared_prefix_items([0], leaders, lp, [20] * 7, max_tokens=9)
    assert over == [[0]] and over_costs == [22]
    assert np.array_equal(prompt_groups([]), np.zeros(0, dtype=np.int64))


def test_balanced_group_partitions_keep_groups_whole():
    uids = [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    costs = [11, 7, 7, 4, 4, 4, 13, 4, 7, 2, 2, 2]
    parts = balanced_group_partitions(uids, costs, 2)
    # verl 0.9.1's group balance: a group's cost its rows' sum, 25, 12, 24, 6; by increasing cost the runs
    # {6, 12} and {24, 25}: the heavier of each with the lighter of the other, 12 + 24 = 36 and 6 + 25 = 31
    assert parts == [[3, 4, 5, 6, 7, 8], [0, 1, 2, 9, 10, 11]]
    assert balanced_group_partitions(uids, costs, 3) is None  # 4 groups over 3 ranks
    assert balanced_group_partitions(uids[:5], costs[:5], 1) is None  # groups of 3 and 2


def test_config_needs_the_packed_layout():
    cfg = load_config(PPOConfig, DEMO, [f"{A}.use_prefix_grouper=true"])
    validate(cfg)
    bad = load_config(PPOConfig, DEMO, [f"{A}.use_prefix_grouper=true", "actor_rollout_ref.model.use_remove_padding=false"])
    with pytest.raises(ConfigError, match="use_prefix_grouper=true with actor_rollout_ref.model.use_remove_padding=false"):
        validate(bad)
