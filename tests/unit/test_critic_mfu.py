"""perf/mfu/critic (verl's, from its critic worker): the FLOPs the value model's update runs (its
blocks, attention and value head, forward and backward, every epoch, over the tokens it trains)
over the update's time and the devices' peak, counted as perf/mfu/actor counts the actor's."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import ModelArgs, Transformer
from trainer.ppo_trainer import critic_update_flops
from trainer.roles import Critic, MicroBatching

# head_dim 8, q 32, kv 16: attention 32·32 + 2·32·16 + 32·32 = 3072, MLP 3·32·64 = 6144, two norms 64:
# 9280 a layer, N_body = 2·9280 + the final norm's 32 = 18592
ARGS = dict(vocab_size=41, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
N_BODY = 18592
PER_TOKEN = 6 * N_BODY + 6 * 32  # blocks forward + backward, and the value head 32 -> 1 (2·32 + 4·32)
PER_PAIR = 12 * 2 * 4 * 8  # QKᵀ and AV, forward + backward: 12·layers·heads·head_dim


def test_critic_update_flops_by_hand():
    args = ModelArgs(**ARGS)
    assert args.num_params(include_embedding=False) == N_BODY
    assert critic_update_flops(args, 100, 0) == 100 * 111744 == 100 * PER_TOKEN
    assert critic_update_flops(args, 7, 30.5) == 7 * PER_TOKEN + 30.5 * PER_PAIR


@pytest.mark.parametrize("targets", [None, "all-linear"])
def test_critic_update_flops_match_the_flop_counter(targets):
    """A value model's forward and backward counted by PyTorch (its matmuls; the CPU attention kernel is
    not one the counter knows): the formula without attention pairs, full and LoRA (frozen base and
    embedding, trained adapters and value head). Biases and norm weights are in N_body but run no matmul."""
    from models.lora import LoRAConfig, inject_lora

    args = ModelArgs(vocab_size=1000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                     num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=128, model_type="qwen2",
                     attention_bias=True)
    model = Transformer.build(args, head="value", seed=0)
    lora = None
    if targets is not None:
        lora = LoRAConfig(rank=8, target_modules=targets)
        inject_lora(model, lora, generator=torch.Generator().manual_seed(0))
        assert model.score.weight.requires_grad
    ids = torch.randint(0, args.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(ids).sum().backward()
    counts = counter.get_flop_counts()["Global"]
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)
    predicted = critic_update_flops(args, 3 * 40, 0, lora=lora)
    assert abs(predicted - counted) / counted < 5e-3, (predicted, counted)


def _rollouts():
    from trainer.rollout_batch import RolloutBatch

    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    responses = [[11, 12], [13, 14, 15, 16], [17], [18, 19, 20]]
    ro = RolloutBatch(prompts, responses, [0, 1, 2, 3], [None] * 4, [None] * 4, [{}] * 4, ["stop"] * 4,
                      [[0.0] * len(r) for r in responses], 4, torch.device("cpu"))
    ro.values = torch.zeros(4, 4)
    ro.returns = torch.linspace(-1, 1, 16).reshape(4, 4) * ro.response_mask
    return ro


def test_trainer_logs_the_critic_mfu(monkeypatch):
    """`PPOTrainer._update_critic` counts the critic's update (2 epochs x 2 mini-batches of rows of 5, 6, 5
    and 4 tokens), `_perf_metrics` turns it into perf/mfu/critic: FLOPs / (update time x peak x ranks)."""
    import trainer.ppo_trainer as pt
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.tracking import Timer

    cfg = load_config(PPOConfig, None, [
        "algorithm.adv_estimator=gae", "data.train_batch_size=4", "critic.ppo_mini_batch_size=2",
        "critic.ppo_epochs=2", "critic.ppo_micro_batch_size_per_gpu=2"])
    value = Transformer.build(ModelArgs(**ARGS), head="value", seed=1)
    critic = Critic(value, torch.optim.SGD(value.parameters(), lr=0.0), SimpleNamespace(step=lambda: None),
                    packed=True, pad_token_id=0, device=torch.device("cpu"), world_size=1, response_length=4,
                    batching=MicroBatching(2, False, 0))
    trainer = object.__new__(pt.PPOTrainer)
    trainer.cfg, trainer.device, trainer.global_step = cfg, torch.device("cpu"), 0
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=0, world_size=1)
    trainer.critic = critic
    trainer.actor = SimpleNamespace(sp_size=1, share_prefix=False)
    trainer._update_work, trainer._infer_work = np.zeros(3), np.zeros(3)
    ro = _rollouts()
    metrics = {}
    with FlopCounterMode(display=False) as counter:
        trainer._update_critic(ro, metrics)
    counts = counter.get_flop_counts()["Global"]
    tokens = 2 * (5 + 6 + 5 + 4)  # two epochs over every prompt and response token
    pairs = 2 * (25 + 36 + 25 + 16) / 2  # causal pairs, Σ L²/2, each epoch
    assert list(trainer._critic_work) == [tokens, 2 * 10, pairs]  # (tokens, scored positions, pairs)
    # what ran, by PyTorch's count of the matmuls: the CPU attention kernel is not one it knows, and the
    # 2·2·32 + 32 = 160 norm weights in N_body run no matmul
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)
    assert counted == tokens * (PER_TOKEN - 6 * 160)

    monkeypatch.setattr(pt, "_peak_flops", lambda device: 1e9)
    metrics.update({"timing_s/step": 2.0, "timing_s/update_critic": 0.5})
    out = trainer._perf_metrics(ro, metrics)
    want = (tokens * PER_TOKEN + pairs * PER_PAIR) / (0.5 * 1e9 * 1)
    assert out["perf/mfu/critic"] == pytest.approx(want, rel=1e-12)
    assert "perf/mfu/actor" not in out  # the actor did not train (critic warm-up)
    # no critic: none
    trainer.critic, trainer._critic_work = None, np.zeros(3)
    assert "perf/mfu/critic" not in trainer._perf_metrics(ro, metrics)


def test_trainer_logs_the_actor_infer_mfu(monkeypatch):
    """verl's perf/mfu/actor_infer: `PPOTrainer._old_log_probs` counts what its forward-only pass runs (rows
    of 5, 6, 5 and 4 tokens, their 10 response positions scored by the LM head) and `_perf_metrics` turns it
    into forward FLOPs (2·N_body a token, 2·hidden·vocab a scored position, 4·layers·heads·head_dim a
    causal pair; verl divides its forward-and-backward estimate by 3) over the pass's time, peak and ranks."""
    import trainer.ppo_trainer as pt
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.roles import Actor
    from trainer.tracking import Timer

    cfg = load_config(PPOConfig, None, [  # two mini-batches: not on-policy, so the old log-probs are recomputed
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2"])
    args = ModelArgs(**ARGS)
    policy = Transformer.build(args, seed=1)
    actor = Actor(policy, torch.optim.SGD(policy.parameters(), lr=0.0), SimpleNamespace(step=lambda: None),
                  temperature=1.0, packed=True, pad_token_id=0, device=torch.device("cpu"), world_size=1,
                  response_length=4, batching=MicroBatching(2, False, 0))
    trainer = object.__new__(pt.PPOTrainer)
    trainer.cfg, trainer.device, trainer.global_step = cfg, torch.device("cpu"), 0
    trainer.timer, trainer.ctx = Timer(trainer.device), SimpleNamespace(rank=0, world_size=1)
    trainer.actor, trainer.critic = actor, None
    trainer.models = SimpleNamespace(actor_args=args, actor=policy)
    trainer._update_work, trainer._critic_work = np.zeros(3), np.zeros(3)
    ro = _rollouts()
    metrics = {}
    with FlopCounterMode(display=False) as counter:
        trainer._old_log_probs(ro, ro, [[0, 1, 2, 3]], metrics)
    tokens, positions, pairs = 5 + 6 + 5 + 4, 10, (25 + 36 + 25 + 16) / 2
    assert list(trainer._infer_work) == [tokens, positions, pairs]
    # the actor's next forwards (a LoRA run's reference pass, the adapters off) are not this pass's work
    actor.log_probs(ro)
    assert list(trainer._infer_work) == [tokens, positions, pairs]
    counts = counter.get_flop_counts()["Global"]
    counted = counts[torch.ops.aten.mm] + counts.get(torch.ops.aten.addmm, 0)
    head = 2 * 32 * 41  # the LM head on a scored position
    assert counted == tokens * 2 * (N_BODY - 160) + positions * head  # (the norm weights run no matmul)

    monkeypatch.setattr(pt, "_peak_flops", lambda device: 1e9)
    metrics.update({"timing_s/step": 2.0, "timing_s/old_log_prob": 0.25})
    out = trainer._perf_metrics(ro, metrics)
    want = (tokens * 2 * N_BODY + positions * head + pairs * PER_PAIR / 3) / (0.25 * 1e9 * 1)
    assert out["perf/mfu/actor_infer"] == pytest.approx(want, rel=1e-12)
    # no old-log-prob pass (an on-policy update makes its own): none
    trainer._infer_work = np.zeros(3)
    assert "perf/mfu/actor_infer" not in trainer._perf_metrics(ro, {"timing_s/step": 2.0})
