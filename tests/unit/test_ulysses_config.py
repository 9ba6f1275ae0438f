"""Ulysses sequence parallelism: its options as verl writes them, the checks against the launch and
the model, and the host-side layout of a token-split micro-batch (no processes: the group is a
stand-in that only says its size and rank)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from sharding.ulysses import SequenceParallel, check_sequence_parallel, group_ranks, per_shard_counts
from trainer.config import PPOConfig, validate
from trainer.configlib import ConfigError, load_config
from trainer.forward import build_micro_batch
from trainer.roles import MicroBatching, sp_batching

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "configs", "demo.yaml")
A = "actor_rollout_ref.actor"
FOUR_RANKS = ("trainer.n_gpus_per_node=4",)


def _cfg(*overrides):
    return load_config(PPOConfig, DEMO, list(overrides))


def _sizes(cfg):
    arr = cfg.actor_rollout_ref
    return (arr.actor.ulysses_sequence_parallel_size, arr.ref.ulysses_sequence_parallel_size,
            cfg.critic.ulysses_sequence_parallel_size, cfg.reward_model.ulysses_sequence_parallel_size)


def test_reference_runs_in_the_actors_groups():
    assert _sizes(_cfg(f"{A}.ulysses_sequence_parallel_size=2")) == (2, 2, 1, 1)
    assert _sizes(_cfg(f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
                       "critic.ulysses_sequence_parallel_size=2")) == (2, 2, 2, 1)
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 differs from "
                                          "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"):
        _cfg(f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1")


def test_verls_fsdp_config_copies_set_the_roles_size():
    """verl's engine workers read `fsdp_config.ulysses_sequence_parallel_size`: a value there is the role's."""
    cfg = _cfg(f"{A}.fsdp_config.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.ulysses_sequence_parallel_size=2",
               "reward_model.model.fsdp_config.ulysses_sequence_parallel_size=2")
    assert _sizes(cfg) == (2, 2, 2, 2)
    assert _sizes(_cfg(f"{A}.ulysses_sequence_parallel_size=2", f"{A}.fsdp_config.ulysses_sequence_parallel_size=2")) \
        == (2, 2, 1, 1)
    with pytest.raises(ConfigError, match=f"{A}.fsdp_config.ulysses_sequence_parallel_size=4 differs from "
                                          f"{A}.ulysses_sequence_parallel_size=2"):
        _cfg(f"{A}.ulysses_sequence_parallel_size=2", f"{A}.fsdp_config.ulysses_sequence_parallel_size=4")
    with pytest.raises(ConfigError, match="critic.model.fsdp_config.ulysses_sequence_parallel_size=4 differs from "
                                          "critic.ulysses_sequence_parallel_size=2"):
        _cfg("critic.ulysses_sequence_parallel_size=2", "critic.model.fsdp_config.ulysses_sequence_parallel_size=4")
    # the reference's copy against the actor's size is named as the user set it (it was named as the
    # reference's own option, which they had not set)
    assert _sizes(_cfg(f"{A}.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2")) == (2, 2, 1, 1)
    with pytest.raises(ConfigError, match="^actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2 differs "
                                          f"from {A}.ulysses_sequence_parallel_size=1"):
        _cfg("actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=2")


@pytest.mark.parametrize("overrides, message", [
    ((f"{A}.ulysses_sequence_parallel_size=3",), f"{A}.ulysses_sequence_parallel_size=3 does not divide the 2 ranks"),
    ((*FOUR_RANKS, "trainer.nnodes=1", f"{A}.ulysses_sequence_parallel_size=8"), "does not divide the 4 ranks"),
    ((f"{A}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=false"),
     f"{A}.ulysses_sequence_parallel_size=2 with actor_rollout_ref.model.use_remove_padding=false"),
    (("algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1", "critic.ulysses_sequence_parallel_size=2",
      "critic.model.use_remove_padding=false"), "critic.ulysses_sequence_parallel_size=2 with "
                                                "critic.model.use_remove_padding=false"),
])
def test_bad_sizes_name_the_option(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_cfg(*overrides))


def test_an_unused_roles_size_is_not_checked():
    """GRPO trains no critic: its size, as verl's scripts leave it, says nothing about this run."""
    validate(_cfg("critic.ulysses_sequence_parallel_size=3"))


def test_launch_and_heads():
    check_sequence_parallel("k", 2, 4, 4, heads=14, kv_heads=2)  # qwen2.5-0.5b over 2
    check_sequence_parallel("k", 4, 8, 8, heads=12, kv_heads=2)  # qwen2.5-1.5b over 4: K/V heads repeated
    for args, message in [((4, 8, 8, 14, 2), "k=4 does not divide the model's 14 attention heads"),
                          ((4, 8, 8, 12, 3), "k=4: the model's 3 key/value heads neither divide among 4 ranks"),
                          ((4, 8, 2, 12, 2), "k=4 does not divide the 2 ranks of a node"),
                          ((2, 3, None, 4, 2), "k=2 does not divide the 3 ranks of the launch")]:
        with pytest.raises(ValueError, match=message):
            check_sequence_parallel("k", *args)
    assert group_ranks(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_preflight_checks_the_models_heads(tmp_path):
    """Before any model is built: a size that does not divide the actor's heads names the option and the model."""
    from trainer import setup

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(
        model_type="qwen2", vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)))
    cfg = _cfg(*FOUR_RANKS, f"actor_rollout_ref.model.path={model}", "trainer.device=cpu", f"{A}.use_dynamic_bsz=true",
               f"{A}.ulysses_sequence_parallel_size=4")
    with pytest.raises(ConfigError, match=f"{A}.ulysses_sequence_parallel_size=4 does not divide the model's 6 "
                                          f"attention heads.*{model}"):
        setup.preflight(cfg)
    setup.preflight(_cfg(*FOUR_RANKS, f"actor_rollout_ref.model.path={model}", "trainer.device=cpu", f"{A}.use_dynamic_bsz=true",
                         f"{A}.ulysses_sequence_parallel_size=2"))


def test_preflight_checks_the_engines_tp_against_the_model(tmp_path):
    """Before any rank starts: an engine TP size that does not divide the model's query heads names
    the option and the model; one that does not divide the vocabulary (a Llama with an added pad
    token: 32001, padded as vLLM does) or the KV heads (copied on the ranks, as vLLM does) is run; a
    model directory that cannot be read is left to the ranks, which say so in one line, rather than
    a traceback here."""
    from trainer import setup

    model = tmp_path / "model"
    model.mkdir()
    config = dict(model_type="qwen2", vocab_size=105, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                  num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64)
    (model / "config.json").write_text(json.dumps(config))
    tp = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    two = ("trainer.n_gpus_per_node=2", "trainer.device=cpu", f"actor_rollout_ref.model.path={model}")
    with pytest.raises(ConfigError, match=rf"^{tp}=2: tensor parallelism 2 needs num_attention_heads \(3\) "
                                          rf"divisible by 2 \(the model in {model}\)$"):
        setup.preflight(_cfg(*two, f"{tp}=2"))
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 4}))
    setup.preflight(_cfg(*two, f"{tp}=2"))  # a vocabulary of 105 padded, the one KV head on both ranks
    setup.preflight(_cfg(*two, f"{tp}=1"))
    missing = ("trainer.n_gpus_per_node=2", "trainer.device=cpu", f"actor_rollout_ref.model.path={tmp_path / 'none'}")
    setup.preflight(_cfg(*missing, f"{tp}=2", f"{A}.ulysses_sequence_parallel_size=2", f"{A}.use_dynamic_bsz=true"))


def test_token_budget_is_per_gpu():
    """verl: a group's dynamic micro-batch holds size x the per-GPU budget; fixed sizes are the group's."""
    b = MicroBatching(4, True, 1000)
    assert sp_batching(b, None) == b
    assert sp_batching(b, SequenceParallel(None, 2, 0)) == MicroBatching(4, True, 2000)


def test_token_split_layout():
    """Each rank's shard of a packed micro-batch, by hand: 3 sequences of 4 + 3, 2 + 2 and 3 + 1
    tokens (15 in all) over 2 ranks is 16 tokens with one padding token, a sequence of its own."""
    prompts, responses = [[1, 2, 3, 4], [5, 6], [7, 8, 9]], [[11, 12, 13], [14, 15], [16]]
    whole = build_micro_batch(prompts, responses, "cpu", packed=True)
    shards = [build_micro_batch(prompts, responses, "cpu", packed=True, sp=SequenceParallel(None, 2, r))
              for r in range(2)]
    flat = whole.input_ids[0].tolist() + [0]
    assert [s.input_ids[0].tolist() for s in shards] == [flat[:8], flat[8:]]
    assert [s.position_ids[0].tolist() for s in shards] == [[0, 1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 0, 1, 2, 3, 0]]
    assert shards[0].cu_seqlens.tolist() == [0, 7, 11, 15, 16] and shards[0].max_seqlen == 7
    assert torch.equal(torch.cat([s.labels[0] for s in shards])[:15], whole.labels[0])
    # the positions that predict response tokens: 3-5 | 8-9 | 13; last positions 6 | 10 | 14
    assert whole.src_index.tolist() == [3, 4, 5, 8, 9, 13] and whole.last_index.tolist() == [6, 10, 14]
    assert [s.src_index.tolist() for s in shards] == [[3, 4, 5], [0, 1, 5]]
    assert [s.last_index.tolist() for s in shards] == [[6], [2, 6]]
    assert shards[0].src_counts == [3, 3] and shards[0].last_counts == [1, 2]
    assert per_shard_counts(np.array([0, 7, 8, 15]), 16, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="needs the packed layout"):
        build_micro_batch(prompts, responses, "cpu", packed=False, sp=SequenceParallel(None, 2, 0))
