"""The roles' `fsdp_config` options change where the states live, never the numbers (gloo, CPU, float32).

One global batch, one clipped actor update and one critic update (SGD, lr 1) and the reference's
log-probs, on 1 rank and on 3 and 4 ranks laid out as FULL_SHARD, HYBRID_SHARD and data parallelism,
with `param_offload` / `optimizer_offload` moving the states out and back between the phases,
`offload_policy`, `reshard_after_forward=false`, `forward_prefetch`, grouped units, and the
reference on options of its own. The model's shapes do not divide over 3 or 4 ranks (a vocabulary of
97 rows, an MLP of 90, K/V biases of 20), so FSDP2 pads uneven shards.

Against the 1-rank run: `actor/grad_norm` and `critic/grad_norm` (the norm before clipping, over every
rank's shards) to float32 reduction-order tolerance, the new weights to 1e-5 where the update moves
them by 0.5 in norm (the clipped step: `grad_clip` below the norm, so the step's norm is `grad_clip`
exactly, checked on the 1-rank run), and the reference's log-probs to 1e-5.
tests/multiproc/test_fsdp.py checks the layouts with a plain loss; test_same_update the actor's
update on 1 and 2 ranks without offload.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

MODEL = dict(vocab_size=97, hidden_size=40, intermediate_size=90, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, model_type="qwen2", attention_bias=True,
             tie_word_embeddings=False)
SEQS, CLIP, TOKENS = 12, 0.5, 40  # 12 rows split over 1, 3 or 4 ranks; micro-batches of at most 40 tokens
FP32 = {"param_dtype": "fp32"}


def _batch():
    """The global batch (prompts, responses, per-token tensors), the same on every rank and launch."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, MODEL["vocab_size"], (int(torch.randint(3, 9, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(SEQS)]
    responses = [torch.randint(2, MODEL["vocab_size"], (int(torch.randint(1, 9, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(SEQS)]
    width = max(len(r) for r in responses)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    tensors = {k: torch.randn(SEQS, width, generator=g) * mask for k in ("advantages", "returns")}
    tensors["values"] = 0.1 * torch.randn(SEQS, width, generator=g) * mask
    tensors["ref_log_probs"] = -4.6 + 0.1 * torch.randn(SEQS, width, generator=g) * mask
    return prompts, responses, width, tensors


def _body(rank, world, out, actor_opts, ref_opts, critic_opts):
    from models import ModelArgs
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model, offloaded_tensors
    from sharding.fsdp import reshard_all
    from tests.gpu.multi_gpu_checks import _rollouts
    from trainer.config import ActorConfig, CriticConfig
    from trainer.roles import Actor, Critic, MicroBatching, ReferencePolicy

    cpu = torch.device("cpu")
    args = ModelArgs(**MODEL)
    prompts, responses, width, tensors = _batch()
    rows = list(range(rank * SEQS // world, (rank + 1) * SEQS // world))
    local = _rollouts([prompts[i] for i in rows], [responses[i] for i in rows], width, cpu)
    for k, v in tensors.items():
        setattr(local, k, v[rows])
    actor_cfg, ref_cfg, critic_cfg = (FSDPConfig(**o, mixed_precision=FP32) for o in (actor_opts, ref_opts, critic_opts))
    mesh = ParallelDims(world, fsdp_size=actor_cfg.fsdp_size).build_meshes("cpu").train
    batching = MicroBatching(None, True, TOKENS)
    common = dict(packed=True, pad_token_id=0, device=cpu, batching=batching)
    out_ = {}

    # The reference, on its own options: twice (a kept-gathered or offloaded model's second pass too).
    ref = ReferencePolicy(build_fsdp_model(args, mesh, ref_cfg, seed=0, trainable=False), temperature=1.0,
                          fsdp_cfg=ref_cfg, **common)
    for _ in range(2):
        assert bool(offloaded_tensors(ref.model)) == ref_cfg.param_offload  # in host memory between its passes
        out_["ref_log_probs"] = _gather(ref.log_probs(local), world)

    # The actor: offloaded and back as around a generation, then one clipped update (1 mini-batch, 1 epoch).
    model = build_fsdp_model(args, mesh, actor_cfg, seed=0)
    actor = Actor(model, torch.optim.SGD(model.parameters(), lr=1.0), None, temperature=1.0, world_size=world,
                  response_length=width, fsdp_cfg=actor_cfg, **common)
    actor.offload()
    actor.load()
    cfg = ActorConfig(ppo_mini_batch_size=SEQS, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=TOKENS,
                      use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01,
                      grad_clip=CLIP)
    metrics = actor.update(local, cfg, 1, 0.1, seed=0, step=1)
    actor.offload()
    actor.load()
    reshard_all(model)
    out_["actor"] = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    out_["actor/grad_norm"] = metrics["actor/grad_norm"]

    critic_model = build_fsdp_model(args, mesh, critic_cfg, head="value", seed=1)
    critic = Critic(critic_model, torch.optim.SGD(critic_model.parameters(), lr=1.0), None, world_size=world,
                    response_length=width, fsdp_cfg=critic_cfg, **common)
    local.values = critic.values(local)  # the critic's own values: the clipped value loss around them
    ccfg = CriticConfig(ppo_mini_batch_size=SEQS, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=TOKENS,
                        grad_clip=CLIP, ppo_epochs=1, shuffle=False, loss_agg_mode="token-mean")
    metrics = critic.update(local, ccfg, 1, seed=0)
    critic.load()
    reshard_all(critic_model)
    out_["critic"] = {n: p.full_tensor().clone() for n, p in critic_model.named_parameters()}
    out_["critic/grad_norm"] = metrics["critic/grad_norm"]
    if rank == 0:
        torch.save(out_, out)


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's rows in rank order: the global batch's."""
    counts = [len(range(r * SEQS // world, (r + 1) * SEQS // world)) for r in range(world)]
    parts = [t.new_zeros((n,) + tuple(t.shape[1:])) for n in counts]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _initial(head: str, seed: int) -> dict:
    from models import ModelArgs, Transformer

    return dict(Transformer.build(ModelArgs(**MODEL), head=head, seed=seed).named_parameters())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_layouts") / "one.pt"
    run_distributed(_body, 1, str(out), {}, {}, {})
    got = torch.load(out)
    # The clipped step: the gradient's norm is above grad_clip, so SGD at lr 1 moves the weights by grad_clip.
    for role, head, seed in (("actor", "lm", 0), ("critic", "value", 1)):
        initial = _initial(head, seed)
        step = torch.linalg.vector_norm(torch.cat([(got[role][n] - p).reshape(-1) for n, p in initial.items()]))
        assert got[f"{role}/grad_norm"] > 2 * CLIP, got[f"{role}/grad_norm"]
        torch.testing.assert_close(step, torch.tensor(CLIP), rtol=1e-4, atol=0)
    return got


LAYOUTS = {
    "full_shard_3_offload": (3, {"param_offload": True, "optimizer_offload": True},
                             {"param_offload": True, "reshard_after_forward": False},
                             {"param_offload": True, "optimizer_offload": True}),
    "hybrid_shard_2x2": (4, {"fsdp_size": 2, "reshard_after_forward": False, "forward_prefetch": True},
                         {"fsdp_size": 2, "param_offload": True, "forward_prefetch": True},
                         {"offload_policy": True, "wrap_policy": {"min_num_params": 1}}),
    "data_parallel_4": (4, {"fsdp_size": 1, "offload_policy": True},
                        {"fsdp_size": 1, "reshard_after_forward": False},
                        {"fsdp_size": 1, "param_offload": True, "optimizer_offload": True}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_update_is_the_single_process_one_in_every_layout(tmp_path, one_rank, layout):
    world, actor_opts, ref_opts, critic_opts = LAYOUTS[layout]
    out = tmp_path / "got.pt"
    run_distributed(_body, world, str(out), actor_opts, ref_opts, critic_opts)
    got = torch.load(out)
    torch.testing.assert_close(got["ref_log_probs"], one_rank["ref_log_probs"], rtol=0, atol=1e-5)
    for role in ("actor", "critic"):
        assert got[f"{role}/grad_norm"] == pytest.approx(one_rank[f"{role}/grad_norm"], rel=1e-5), role
        for name, p in got[role].items():
            torch.testing.assert_close(p, one_rank[role][name], rtol=0, atol=1e-5, msg=lambda m: f"{role} {name}: {m}")
