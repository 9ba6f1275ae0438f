"""Multi-rank checks over NCCL, one per launch (tests/gpu/test_multi_gpu.py runs them on 2 GPUs):

    torchrun --nproc_per_node=N tests/gpu/multi_gpu_checks.py CHECK [--out FILE] [--work-dir DIR]
                                                              [--device cuda|cpu] [--shape auto|small|full]

* `trainer`: the real trainer, 3 steps per configuration: GRPO (n=4) and PPO (GAE + critic) x
  {FULL_SHARD with engine TP 1, FULL_SHARD with TP 2, HYBRID_SHARD 2 replicas x 1 shard,
  FSDP2 `offload_policy`, LoRA on the actor and the critic with engine TP 2, Ulysses groups of 2
  for the actor and the critic, rollout correction's batch normalisation (and PF-PPO)}, bf16, the
  qwen2.5-1.5b shape cut to 2 layers, CUDA graphs on. A watched weight must move in every
  configuration; under LoRA an adapter must move and the base weight must not.
* `same_update`: `Actor.update` (2 mini-batches, dynamic micro-batches, KL and entropy
  losses, SGD) on one fixed global batch (`--sp 2`: in one Ulysses group); rank 0 saves the parameters before and after to
  `--out`, and the test compares a 1-rank and a 2-rank launch.
* `engine_tp`: TP 2 against TP 1: float32 small models (tokens equal, greedy and sampled), and
  bf16 at the qwen2.5-1.5b shape (log-probs on the common greedy prefix, statistical bounds);
  on CUDA the symmetric-memory all-reduce of the TP group against NCCL's, bitwise, eagerly and
  in a CUDA graph.
* `reshard`: the resharder's slots against the full weights cast to bf16, bitwise, on both
  paths, for FULL_SHARD TP 1 / TP 2 and HYBRID_SHARD 2 x 1; a LoRA actor's adapters merged
  into the slots (tests/multiproc/test_resharder_lora.py's check) at TP 1 and TP 2; and a
  Qwen3-MoE's experts (tests/multiproc/test_resharder_moe.py's check) at TP 1 and TP 2.

Rank 0 prints one JSON line of measured figures per check and `CHECK ok` at the end; a failed
assertion exits non-zero (torchrun then stops the other ranks). `--device cpu` runs the same
logic on gloo (small shapes by default), to debug it without GPUs.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import math
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 3

# Varies inside every group of random responses, so GRPO and GAE advantages are never all zero
# (the bench's rule scores random text 0 almost everywhere: no policy gradient at all).
PARITY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(ord(c) % 2 for c in solution_str) / max(len(solution_str), 1)
'''


def _emit(ctx, check: str, **figures):
    if ctx.is_main:
        print(json.dumps({"check": check, **figures}), flush=True)


def _free_device_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- trainer
TRAINER_LAYOUTS = {
    "full_shard_tp1": [],
    "full_shard_tp2": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
    "hybrid_shard_tp1": ["actor_rollout_ref.actor.fsdp_config.fsdp_size=1"],
    "offload_policy_tp1": ["actor_rollout_ref.actor.fsdp_config.offload_policy=true"],
    # LoRA on the actor (its reference: the actor with adapters off) and on the critic, engine TP 2
    "lora_tp2": ["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.model.lora_rank=8",
                 "actor_rollout_ref.model.lora_alpha=16", "critic.model.lora_rank=8", "critic.model.lora_alpha=16"],
    # Ulysses: the 2 GPUs one group for the actor, reference and critic (all-to-alls and gathers over NCCL)
    "ulysses_tp1": ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"],
    # the trainer's batch-wide collectives: rollout correction's weights normalised over the batch,
    # and (PPO) PF-PPO's redraw
    "batch_collectives_tp1": ["algorithm.rollout_correction.rollout_is=token",
                              "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
}
WATCHED_PARAM = "layers.1.self_attn.q_proj.weight"
WATCHED_ADAPTER = "layers.1.self_attn.q_proj.lora_B"  # what trains instead under LoRA (starts at zero)


def _local_copy(model, name: str) -> torch.Tensor:
    from sharding.fsdp import reshard_all

    reshard_all(model)  # the registered parameters are then the sharded DTensors
    return dict(model.named_parameters())[name].to_local().detach().float().cpu().clone()


def check_trainer(ctx, a):
    from bench.common import model_args
    from bench.ppo_step import SMOKE_SHAPE, overrides_for, prepare
    from trainer.config import PPOConfig
    from trainer.configlib import load_config
    from trainer.ppo_trainer import PPOTrainer

    cuda = ctx.device.type == "cuda"
    full = a.shape == "full" or (a.shape == "auto" and cuda)
    shape = dict(num_hidden_layers=2) if full else SMOKE_SHAPE
    prompts, prompt_len, response_len = (8, 64, 32) if full else (8, 16, 8)
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, data, _ = prepare(work, "qwen2.5-1.5b", prompts * STEPS, prompt_len, ctx.rank, shape)
    reward = work / "parity_reward.py"
    if ctx.is_main:
        reward.write_text(PARITY_REWARD)
    dist.barrier()
    dtype = ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
             "actor_rollout_ref.rollout.dtype=bfloat16"] if cuda else []
    summary = {"model": "qwen2.5-1.5b" if full else "smoke", "layers": model_args("qwen2.5-1.5b", **shape).num_hidden_layers}
    for workload, n in (("grpo", 4), ("ppo", 1)):
        for layout, extra in TRAINER_LAYOUTS.items():
            if a.layouts and layout not in a.layouts.split(","):
                continue
            name = f"{workload}_{layout}"
            if workload == "ppo" and "offload_policy" in layout:
                extra = extra + ["critic.model.fsdp_config.offload_policy=true"]
            if workload == "ppo" and layout == "batch_collectives_tp1":
                extra = extra + ["algorithm.use_pf_ppo=true"]
            run_dir = work / f"run_{name}"
            if ctx.is_main and (run_dir / "metrics.jsonl").exists():
                os.remove(run_dir / "metrics.jsonl")
            dist.barrier()
            overrides = overrides_for(workload, prompts, prompt_len, response_len) + [
                f"actor_rollout_ref.model.path={model_dir}", f"data.train_files=[{data}]",
                f"custom_reward_function.path={reward}", f"trainer.default_local_dir={run_dir}",
                f"trainer.total_training_steps={STEPS}", f"trainer.n_gpus_per_node={ctx.world_size}",
                "data.shuffle=false", "actor_rollout_ref.actor.use_torch_compile=false",
                f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                # Without weight decay a parameter moves only if its gradient is non-zero.
                "actor_rollout_ref.actor.optim.weight_decay=0", "critic.optim.weight_decay=0",
                *dtype, *extra]
            trainer = PPOTrainer(load_config(PPOConfig, None, overrides), ctx)
            models = {"actor": trainer.models.actor, "critic": trainer.models.critic}
            models = {role: m for role, m in models.items() if m is not None}
            lora = "lora" in layout
            # Under LoRA the adapter moves and the base (the reference's weights) must not.
            trains, frozen = (WATCHED_ADAPTER, WATCHED_PARAM) if lora else (WATCHED_PARAM, None)
            before = {(role, p): _local_copy(m, p) for role, m in models.items() for p in (trains, frozen) if p}
            assert trainer.train() == 0, name
            change = {key: (_local_copy(models[key[0]], key[1]) - v).abs().max().item() for key, v in before.items()}
            for (role, param), c in change.items():
                if param == trains:
                    assert c > 0, f"{name}: rank {ctx.rank}'s shard of the {role}'s {param} did not change in {STEPS} steps"
                else:
                    assert c == 0, f"{name}: the {role}'s frozen {param} changed by {c}"
            moved = change[("actor", trains)]
            graphs = trainer.engine.runner.num_captures
            if cuda:
                # Decode replays CUDA graphs (enforce_eager is false); under TP 2 they hold the
                # engine's NCCL all-reduces.
                assert graphs > 0, f"{name}: the engine decoded without CUDA graphs"
            if ctx.is_main:
                rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
                rows = [r for r in rows if "actor/pg_loss" in r]
                assert len(rows) == STEPS, f"{name}: {len(rows)} metric rows, expected {STEPS}"
                keys = ["actor/pg_loss", "actor/grad_norm", "perf/throughput"]
                if workload == "ppo":
                    keys += ["critic/vf_loss", "critic/grad_norm"]
                for i, row in enumerate(rows):
                    for k in keys:
                        assert isinstance(row.get(k), (int, float)) and math.isfinite(row[k]), (name, i, k, row.get(k))
                    assert row["actor/grad_norm"] > 0 and row["perf/throughput"] > 0, (name, i, row)
                    assert row.get("actor/nonfinite_skipped", 0.0) == 0.0, (name, i, row)
                    if cuda:  # the update phase's peak (a CUDA figure) is part of the step's
                        assert 0 < row["perf/max_memory_allocated_update_gb"] <= row["actor/perf/max_memory_allocated_gb"], row
                summary[name] = {"throughput_tok_s_per_gpu": [round(r["perf/throughput"], 1) for r in rows],
                                 "actor_grad_norm": [round(r["actor/grad_norm"], 4) for r in rows],
                                 "step_s": [round(r["timing_s/step"], 2) for r in rows],
                                 "cuda_graphs": graphs, "actor_param_max_change": moved}
            del trainer
            _free_device_memory(ctx.device)
            # The trainer always checkpoints its last step (DCP, every rank): that ran, but 4-8 GB
            # a configuration at this shape need not stay on disk.
            dist.barrier()
            if ctx.is_main:
                shutil.rmtree(run_dir / "checkpoints")
    _emit(ctx, "trainer", **summary)


# ----------------------------------------------------------------------------- same_update
UPDATE_MODEL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=128, model_type="qwen2", attention_bias=True,
                    tie_word_embeddings=True)
UPDATE_SEQS, UPDATE_MINI_BATCHES = 16, 2


def _rollouts(prompts, responses, width, device):
    from trainer.rollout_batch import RolloutBatch

    n = len(prompts)
    return RolloutBatch(prompts, responses, list(range(n)), [None] * n, [None] * n, [{} for _ in range(n)],
                        ["length"] * n, [[] for _ in range(n)], width, device)


def check_same_update(ctx, a):
    from models import ModelArgs, Transformer
    from trainer.config import ActorConfig
    from trainer.roles import Actor, MicroBatching, ReferencePolicy, plan_micro_batches
    from sharding import FSDPConfig, ParallelDims, build_fsdp_model
    from sharding.ulysses import apply_sequence_parallel, build_sequence_parallel

    w, r, dev = ctx.world_size, ctx.rank, ctx.device
    args = ModelArgs(**UPDATE_MODEL)
    # The global batch: the same on every launch whatever the world size.
    g = torch.Generator().manual_seed(11)
    rand = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))  # noqa: E731
    prompts = [torch.randint(2, args.vocab_size, (rand(4, 25),), generator=g).tolist() for _ in range(UPDATE_SEQS)]
    responses = [torch.randint(2, args.vocab_size, (rand(1, 25),), generator=g).tolist() for _ in range(UPDATE_SEQS)]
    width = max(len(x) for x in responses)
    full = _rollouts(prompts, responses, width, torch.device("cpu"))
    # Log-probs of the initial policy from an unsharded CPU copy (bitwise the same on every
    # launch); old and reference log-probs sit 0.1 nats around them, so the PPO ratios are near 1.
    reference = ReferencePolicy(Transformer.build(args, seed=0), packed=True, temperature=1.0, pad_token_id=0,
                                device=torch.device("cpu"), batching=MicroBatching(None, False, 0))
    logp = reference.log_probs(full)
    mask = full.response_mask
    tensors = {"old_log_probs": (logp + 0.1 * torch.randn(logp.shape, generator=g)) * mask,
               "ref_log_probs": (logp + 0.1 * torch.randn(logp.shape, generator=g)) * mask,
               "advantages": torch.randn(logp.shape, generator=g) * mask}

    # The worker cuts its own rows into mini-batches in order; dealing rank r the r-th slice of
    # every global mini-batch makes mini-batch m the same sequences at any world size.
    # With Ulysses groups of `a.sp` ranks the data-parallel group d = r // sp is dealt those rows, and
    # its ranks hold consecutive pieces of them: pooled in rank order they are the group's rows.
    per_mini = UPDATE_SEQS // UPDATE_MINI_BATCHES
    dp, d, j = w // a.sp, r // a.sp, r % a.sp
    assert per_mini % w == 0, f"{UPDATE_SEQS} sequences in {UPDATE_MINI_BATCHES} mini-batches do not split over {w} ranks"
    group = [m * per_mini + d * per_mini // dp + i for m in range(UPDATE_MINI_BATCHES) for i in range(per_mini // dp)]
    rows = group[j * len(group) // a.sp:(j + 1) * len(group) // a.sp]
    local = _rollouts([prompts[i] for i in rows], [responses[i] for i in rows], width, dev)
    for k, v in tensors.items():
        setattr(local, k, v[rows].to(dev))

    # fsdp_size -1: FULL_SHARD over the ranks; 1: data parallelism (the replicated runtime, its
    # gradients reduced once per mini-batch, in the last micro-batch's backward).
    meshes = ParallelDims(w, fsdp_size=a.fsdp_size).build_meshes(dev.type)
    model = build_fsdp_model(args, meshes.train, FSDPConfig(fsdp_size=a.fsdp_size, mixed_precision={"param_dtype": "fp32"}),
                             device=dev, seed=0)
    sp = build_sequence_parallel(a.sp, w, dev.type)
    apply_sequence_parallel(model, sp)
    # A copy: on one rank full_tensor() may hand back the parameter's own storage.
    before = {n: p.full_tensor().detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    # SGD: the update is lr x the (clipped) gradient, with no Adam normalisation to magnify
    # rounding differences of tiny gradient entries into full-size steps.
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    worker = Actor(model, optimizer, None, packed=True, temperature=1.0, pad_token_id=0, device=dev, world_size=w,
                   response_length=width, sp=sp)
    # Ratio clips out of reach: a clip decision is a step in the loss, which a ratio within
    # rounding of the boundary would take differently on 1 and 2 ranks.
    cfg = ActorConfig(ppo_mini_batch_size=per_mini, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64,
                      use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", entropy_coeff=0.01,
                      clip_ratio=10.0, clip_ratio_c=100.0)
    micro = len(plan_micro_batches(list(range(len(local) // UPDATE_MINI_BATCHES)), local.lengths(), None, True,
                                   cfg.ppo_max_token_len_per_gpu))
    metrics = worker.update(local, cfg, UPDATE_MINI_BATCHES, cfg.kl_loss_coef, seed=0, step=1)
    for k in ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss", "actor/grad_norm"):
        assert math.isfinite(metrics[k]), (k, metrics)
    assert metrics["actor/grad_norm"] > cfg.grad_clip, metrics  # the global norm's clipping takes part
    assert metrics["actor/pg_clipfrac"] == 0 and metrics["actor/pg_clipfrac_lower"] == 0, metrics
    after = {n: p.full_tensor().detach().to("cpu", copy=True) for n, p in model.named_parameters()}
    if ctx.is_main:
        torch.save({"world_size": w, "before": before, "after": after, "metrics": metrics}, a.out)
    _emit(ctx, "same_update", world_size=w, micro_batches_first_mini_batch=micro,
          max_update=max((after[n] - before[n]).abs().max().item() for n in after),
          **{k: metrics[k] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm")})


# ----------------------------------------------------------------------------- engine_tp
SMALL_BF16 = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, model_type="qwen2", attention_bias=True,
                  tie_word_embeddings=True)
BF16_PROMPTS, BF16_NEW_TOKENS = 32, 32
LOGIT_STD, OUT_GAIN = 4.0, 3.0


def _scaled_weights(args, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Full bf16 tensors, the same on every rank (CPU generator), for a random model whose greedy
    output is neither flat nor degenerate. The initialisation's std 0.02 gives near-flat logits,
    whose greedy choices any rounding flips. Here: the tied embedding has std
    LOGIT_STD / sqrt(hidden), so the logits' std is about LOGIT_STD; input projections have gain 1
    (std 1 / sqrt(fan_in)), so attention scores have a std near 1; the row-parallel outputs
    (o_proj, down_proj) have gain OUT_GAIN, so the blocks outweigh the embedding in the residual
    stream (else the embedding's similarity with itself makes the model repeat its last token)."""
    from models import Transformer

    with torch.device("meta"):
        model = Transformer(args)
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, p in model.named_parameters():
        x = torch.randn(p.shape, generator=g)
        if "norm" in name:
            x = 1 + 0.1 * x
        elif name.endswith("bias"):
            x = 0.1 * x
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            x = x * LOGIT_STD / math.sqrt(args.hidden_size)
        else:
            gain = OUT_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            x = x * gain / math.sqrt(p.shape[1])
        out.append((name, x.to(torch.bfloat16)))
    return out


def _bf16_tp2_vs_tp1(ctx, full_shape: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from bench.common import model_args
    from models import ModelArgs
    from rollout import EngineConfig, LLMEngine, SamplingParams

    args = model_args("qwen2.5-1.5b", num_hidden_layers=2) if full_shape else ModelArgs(**SMALL_BF16)
    weights = _scaled_weights(args, seed=7)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, args.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 41, (BF16_PROMPTS,), generator=g)]
    max_len = 40 + BF16_NEW_TOKENS
    cfg = EngineConfig(dtype=torch.bfloat16, max_model_len=max_len, max_num_seqs=BF16_PROMPTS,
                       num_kv_blocks=BF16_PROMPTS * -(-max_len // 16) + 8)
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("tp",))
    tp2 = LLMEngine(args, cfg, tp_mesh=mesh["tp"], device=ctx.device)
    tp2.load_weights(weights)
    tp1 = LLMEngine(args, cfg, device=ctx.device)
    tp1.load_weights(weights)
    del weights
    sp = SamplingParams(temperature=0, max_tokens=BF16_NEW_TOKENS, ignore_eos=True)
    one, two = tp1.generate(prompts, sp), tp2.generate(prompts, sp)
    graphs = len(tp2.runner.graphs)
    if ctx.device.type == "cuda":
        assert graphs > 0, "the TP 2 engine decoded without CUDA graphs"
    diffs, prefixes = [], []
    for a, b in zip(one, two):
        k = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        prefixes.append(k)
        diffs += [abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k])]
    distinct = len({t for o in one for t in o.token_ids})
    stats = {"shape": "qwen2.5-1.5b, 2 layers" if full_shape else "small", "common_prefix": prefixes,
             "logprob_diff_mean": sum(diffs) / max(len(diffs), 1), "logprob_diff_max": max(diffs, default=0.0),
             "agree_8": sum(k >= 8 for k in prefixes) / len(prefixes), "distinct_tokens": distinct,
             "mean_logprob": sum(x for o in one for x in o.logprobs) / (BF16_PROMPTS * BF16_NEW_TOKENS),
             "cuda_graphs": graphs, "tp_all_reduce": tp2.tp_all_reduce}
    del tp1, tp2
    _free_device_memory(ctx.device)
    return stats


def _symm_mem_all_reduce(ctx) -> dict:
    """The symmetric-memory all-reduce of the engine's TP group equals NCCL's, eagerly and
    replayed from a CUDA graph (as the decode steps run it). Two ranks: each sum is one
    rounding of a + b, whichever kernel adds, so the results are bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh

    from rollout.parallel import TPGroup

    mesh = init_device_mesh("cuda", (ctx.world_size,), mesh_dim_names=("tp",))
    tp = TPGroup.from_mesh(mesh["tp"])
    shape = (256, 3584)  # a decode step's [batch, hidden] at the 7b shape
    assert tp.setup_all_reduce("symm_mem", ctx.device, torch.bfloat16, max_numel=8192 * 3584) == "symm_mem"
    g = torch.Generator(device=ctx.device).manual_seed(11 + ctx.rank)
    x = torch.randn(shape, generator=g, device=ctx.device).to(torch.bfloat16)
    want = x.clone()
    dist.all_reduce(want, group=tp.group)
    eager = tp.all_reduce(x.clone())
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tp.all_reduce(static.clone())  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(static)
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager, want) and torch.equal(out, want), (eager - want).abs().max()
    odd = torch.randn(3, 5, generator=g, device=ctx.device).to(torch.bfloat16)  # not 16-byte splittable: NCCL
    want_odd = odd.clone()
    dist.all_reduce(want_odd, group=tp.group)
    assert torch.equal(tp.all_reduce(odd), want_odd)
    return {"symm_mem_all_reduce": "equal to NCCL, eager and in a CUDA graph"}


def check_engine_tp(ctx, a):
    from tests.multiproc.test_engine_tp import check_tp2_equals_tp1

    assert ctx.world_size == 2, "engine_tp compares TP 2 with TP 1: launch 2 ranks"
    if ctx.device.type == "cuda":
        _emit(ctx, "engine_tp", **_symm_mem_all_reduce(ctx))
    # float32: only the order of the partial sums of the row-parallel all-reduce differs.
    check_tp2_equals_tp1(ctx.rank, ctx.device, 1e-4)
    stats = _bf16_tp2_vs_tp1(ctx, a.shape == "full" or (a.shape == "auto" and ctx.device.type == "cuda"))
    _emit(ctx, "engine_tp", **stats)
    # bf16 tolerances. TP 2 rounds each row-parallel output to bf16 as two partial sums before
    # adding them (TP 1 rounds it once): the hidden state moves by ~2^-8 relative, the logits by
    # about that times LOGIT_STD, and a greedy path splits at the first near-tie of its top two
    # logits. Measured at the 1.5b shape on CPU (gloo; these weights and prompts): mean |dlogp|
    # 0.023, max 0.125 on the common prefixes, 91 % of the sequences agree on 8 tokens or more.
    # A wrong shard or a lost all-reduce moves log-probs by O(1) and splits every sequence at once.
    assert stats["distinct_tokens"] >= BF16_PROMPTS * BF16_NEW_TOKENS // 8, stats  # no copy loops
    assert stats["agree_8"] >= 0.5, stats
    assert stats["logprob_diff_mean"] < 0.06 and stats["logprob_diff_max"] < 0.5, stats


# ----------------------------------------------------------------------------- reshard
RESHARD_LAYOUTS = [(-1, 1), (-1, 2), (1, 1)]  # (fsdp_size, tp) on 2 ranks
LORA_RESHARD_LAYOUTS = [(-1, 1, "even"), (-1, 2, "even"), (-1, 1, "uneven")]  # (fsdp_size, tp, model)


def check_reshard(ctx, a):
    from tests.multiproc.test_resharder import MODELS, _check
    from tests.multiproc.test_resharder_lora import _check as _check_lora
    from tests.multiproc.test_resharder_moe import ARGS as QWEN3_MOE, GRANITE_MOE_SHARED, QWEN2_MOE, check_moe

    for fsdp_size, tp in RESHARD_LAYOUTS:
        for kind in MODELS:
            _check(ctx.rank, ctx.world_size, fsdp_size, tp, kind, ctx.device)
            _free_device_memory(ctx.device)
    # A LoRA actor: adapters gathered on the device and merged into the engine's slots.
    for fsdp_size, tp, kind in LORA_RESHARD_LAYOUTS:
        _check_lora(ctx.rank, ctx.world_size, fsdp_size, tp, kind, ctx.device)
        _free_device_memory(ctx.device)
    # mixtures of experts: down_proj on its TP dimension, gate_up_proj whole (TP 1) or by all-to-all (TP 2); a
    # Qwen2-MoE's shared expert as a dense MLP, its [1, H] gate whole; a Granite-MoE-Shared's, ungated
    for args in (QWEN3_MOE, QWEN2_MOE, GRANITE_MOE_SHARED):
        for tp in (1, 2):
            check_moe(ctx.rank, ctx.world_size, tp, ctx.device, args=args)
            _free_device_memory(ctx.device)
    _emit(ctx, "reshard", layouts=RESHARD_LAYOUTS, models=list(MODELS), lora_layouts=LORA_RESHARD_LAYOUTS,
          moe_tp=[1, 2], moe_models=["qwen3_moe", "qwen2_moe", "granitemoeshared"])


CHECKS = {"trainer": check_trainer, "same_update": check_same_update, "engine_tp": check_engine_tp,
          "reshard": check_reshard}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("check", choices=sorted(CHECKS))
    p.add_argument("--out", help="same_update: file rank 0 writes the parameters to")
    p.add_argument("--work-dir", default="runs/multi_gpu_checks", help="trainer: model, data and run directories")
    p.add_argument("--fsdp-size", type=int, default=-1, choices=(-1, 1),
                   help="same_update: -1 FULL_SHARD over the ranks, 1 data parallelism (shard groups of one rank)")
    p.add_argument("--sp", type=int, default=1, help="same_update: Ulysses group size")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layouts", default="", help=f"trainer: comma-separated layouts to run (default: all of "
                                                  f"{', '.join(TRAINER_LAYOUTS)})")
    p.add_argument("--shape", default="auto", choices=("auto", "small", "full"),
                   help="model of the trainer and the bf16 engine checks; auto: full on cuda, small on cpu")
    a = p.parse_args(argv)
    if a.check == "same_update" and not a.out:
        p.error("same_update needs --out FILE")
    if unknown := set(filter(None, a.layouts.split(","))) - set(TRAINER_LAYOUTS):
        p.error(f"--layouts: unknown {sorted(unknown)}; choose from {', '.join(TRAINER_LAYOUTS)}")
    # Full float32 matmuls: the float32 comparisons would otherwise see TF32's 10-bit mantissa.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from trainer.launch import init_distributed

    # A hang fails within 5 minutes instead of holding both GPUs until the test's own timeout;
    # the NCCL watchdog's abort then prints every thread's Python stack.
    faulthandler.enable()
    ctx = init_distributed(a.device, timeout_s=300)
    if ctx.device.type == "cpu":
        torch.set_num_threads(1)
    CHECKS[a.check](ctx, a)
    dist.barrier()
    if ctx.is_main:
        print(f"{a.check} ok", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown, as tests/dist_utils.py's ranks do: destroying gloo's
    # (and subgroups') background threads at exit can abort a rank ("terminate called without an
    # active exception", exit -6) after its check passed, on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
