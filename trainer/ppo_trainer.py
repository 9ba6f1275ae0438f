"""The KL-PPO trainer: one SPMD program, the same on every rank.

`PPOTrainer.step` is the whole algorithm in order (docs/ARCHITECTURE.md):

    rollout (reshard -> generate -> free engine memory) -> rewards -> old / ref log-probs,
    values -> KL in reward -> advantages -> critic update -> actor update -> metrics -> checkpoint

The roles (`trainer.roles`: actor, reference, critic, reward model) and the rollout phase
(`trainer.rollout_phase`) do the work of the phases and own their memory moves. Everything
else here is set-up (models, roles, engine, data), validation, checkpoints and the reactions
of the KL guard.
"""

from __future__ import annotations

import collections
import dataclasses
import faulthandler
import functools
import math
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist

from models import peak_bf16_flops
from data.dataset import TOOL_AGENT
from models.checkpoint import CheckpointFileError
from models.tokenizer import decode_batch
from kl import FixedKLController, KLCoefficients, KLGuard, get_kl_controller, kl_penalty
from trainer import faults, gc_control
from trainer.checkpointing import (CheckpointManager, RngSnapshot, agreed_user_error, agreed_write, export_hf,
                                  rng_set_aside)
from trainer.config import (ADAPTER_EXPORT, FILTER_GROUP_SEQUENCE_METRICS, HF_EXPORT, OTB_ESTIMATORS, PPOConfig,
                            as_set, full_determinism_sections, paths_read_under, validate)
from trainer.configlib import ConfigError, to_commented_yaml
from trainer.errors import StopTraining, UserError, say
from ppo.core_algos import (compute_pf_ppo_indices, compute_rollout_correction, get_adv_estimator_fn, masked_mean,
                             rollout_probs_diff_metrics)
from trainer.launch import DistContext, collective_failure_exit, init_distributed, stopping_on_error
from trainer.metrics import data_metrics, trajectory_version_metrics, turn_counts, variance_proxy_metrics
from trainer.batching import Ragged
from trainer.forward import rows_in_order
from trainer.rollout_batch import TOKEN_FIELDS, RolloutBatch
from trainer.roles import (Actor, AdaptersOffReference, Critic, MicroBatching, Reference, ReferencePolicy,
                           RewardModel, agg_loss_global, masked_mean_global)
from rollout.sequence import derive_seed
from trainer.rollout_phase import AgentRows, build_rollout
from trainer.setup import build_engine, build_models, load_actor_tokenizer, reward_model_inputs
from trainer.profiling import StepProfiler, last_step_note, profile_plan
from trainer.tracking import PeakMemory, Timer, Tracking, dump_generations, dump_value, run_info
from trainer.val_metrics import validation_metrics
from sharding import comm

# Multi-turn rollouts at engine TP > 1: the engine steps between the tool agent's looks at samples
# waiting for a tool that awaits I/O, when none began to wait (each look is one broadcast over the TP group).
TP_POLL_STEPS = 8


class _AbandonStep(Exception):
    """Preemption: the rest of this step would not fit in the grace period."""


def _seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def enable_full_determinism() -> None:
    """`fsdp_config.full_determinism`: the process's kernels become deterministic. torch's
    deterministic algorithms (an op without a deterministic implementation raises, naming it;
    FlashAttention's backward takes its deterministic path), cuBLAS with a fixed workspace
    (`CUBLAS_WORKSPACE_CONFIG`, read when cuBLAS starts: the trainer sets it before its first GEMM,
    unless the environment sets it), cuDNN without autotuning. Uninitialized memory is not filled:
    the engine's paged KV cache and CUDA-graph buffers are read only where written. meshppo's own
    kernels use no atomics, and its random draws follow trainer.seed."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))


def critic_update_flops(args, tokens: float, attention_pairs: float, lora=None) -> float:
    """The FLOPs a value model's update runs over `tokens` run (forward and backward, every epoch's) and
    `attention_pairs`: its blocks and attention as `ModelArgs.flops` counts them (no LM head: a value
    model has none), plus its value head, `hidden -> 1` on every position, trained even under LoRA
    (2·hidden forward, 4·hidden backward)."""
    return (args.flops(tokens, 0, attention_pairs, backward=True, lora=lora)
            + 6 * args.hidden_size * tokens)


def val_samples_to_log(tokenizer, samples: list[tuple], k: int) -> list[tuple[str, str, str, float]]:
    """`trainer.log_val_generations`' `k` of the validation `samples` (prompt ids, response, score)
    as (prompt, prompt with its special tokens, response, score), picked as verl picks its table's:
    sorted by the prompt decoded without special tokens (verl's text), shuffled by a generator seeded
    42, the first `k`, so they spread over the prompts and are the same at every validation. The
    loggers get verl's text, the console the prompt with its special tokens (the chat template's)."""
    keyed = sorted(((tokenizer.decode(ids, skip_special_tokens=True), ids, response, score)
                    for ids, response, score in samples), key=lambda sample: sample[0])
    np.random.RandomState(42).shuffle(keyed)
    return [(text, tokenizer.decode(ids, skip_special_tokens=False), response, score)
            for text, ids, response, score in keyed[:k]]


def contiguous_parts(n: int, k: int) -> list[list[int]]:
    """`n` rows cut into `k` consecutive blocks in their order, as equal as they divide (the partition
    without `trainer.balance_batch`)."""
    return [list(range(r * n // k, (r + 1) * n // k)) for r in range(k)]


def partition_rows(ro: RolloutBatch, ranks: int, group: int, balance: bool, keep_prompts: bool) -> list[list[int]]:
    """Every rank's rows of `ro` (equally many each), for `ranks` ranks in data-parallel groups of `group`
    consecutive ranks (a role's Ulysses groups, whose ranks pool their rows: `roles.pool_rows`). With
    `balance` (`trainer.balance_batch`) the rows are balanced over the groups as verl 0.9.1's trainer
    balances over its data-parallel size: its work estimate of each row (`seqlen_workload`), equally many
    rows a group by Karmarkar-Karp (`balanced_equal_partitions`), each part in the batch's order; the
    partition decides the rows of each mini-batch (a group cuts them from its part). With `keep_prompts`
    (prefix sharing) whole prompt groups where they divide evenly (`balanced_group_partitions`). Without
    `balance`, consecutive blocks. Each group's part is then cut into its ranks' consecutive shares, so
    that the group pools its part back in its order, and the ranks of any role's groups (consecutive
    ranks) pool consecutive rows of the balanced order, as verl's workers of another data-parallel size
    take consecutive chunks of its reordered batch."""
    from trainer.batching import balanced_equal_partitions, balanced_group_partitions, seqlen_workload

    groups = ranks // group
    if not balance:
        parts = contiguous_parts(len(ro), groups)
    else:
        work = seqlen_workload(ro.lengths())
        parts = balanced_group_partitions(ro.uids, work, groups) if keep_prompts else None
        if parts is None:
            parts = balanced_equal_partitions(work, groups)
    return [[part[i] for i in share] for part in parts for share in contiguous_parts(len(part), group)]


def seqlen_balance_metrics(lengths: list[int], parts: list[list[int]], group: int = 1) -> dict[str, float]:
    """verl's `global_seqlen/*` figures of a balanced partition (its `log_seqlen_unbalance`): each
    data-parallel part's tokens (`lengths`: each row's prompt + response, attention-mask tokens, which the
    partition balances) before balancing, the batch cut into consecutive blocks in its order (`min`,
    `max`, `minmax_diff`), and after it (`balanced_min`, `balanced_max`); `mean`, the batch's tokens over
    the parts. `parts`: every rank's rows, the parts of `group` consecutive ranks (a Ulysses group,
    `partition_rows`) counting as one, as verl counts its data-parallel ranks."""
    parts = [[i for part in parts[g:g + group] for i in part] for g in range(0, len(parts), group)]
    before = [sum(lengths[i] for i in block) for block in contiguous_parts(len(lengths), len(parts))]
    after = [sum(lengths[i] for i in part) for part in parts]
    return {"global_seqlen/min": float(min(before)), "global_seqlen/max": float(max(before)),
            "global_seqlen/minmax_diff": float(max(before) - min(before)),
            "global_seqlen/balanced_min": float(min(after)), "global_seqlen/balanced_max": float(max(after)),
            "global_seqlen/mean": sum(lengths) / len(parts)}


def reward_row_names(batch: RolloutBatch, items: list[dict], what: str) -> list[str]:
    """How a reward error names each row of `batch` (its `row_names`; `items`: what it was generated
    from, which `batch.uids` index): its position in `what` (in the step's batch, the row's place in its
    rollout dump, 0-based), which response to which prompt of `what` it is and, where the item has one
    (a dataset's `where`), the prompt's data row FILE:ROW. Made from the whole batch before it is
    partitioned, and kept with each row by `RolloutBatch.take`, so a row has the same name on any
    number of ranks, balanced (`trainer.balance_batch`) or not."""
    responses = collections.Counter(batch.uids)
    seen: collections.Counter = collections.Counter()
    names = []
    for i, u in enumerate(batch.uids):
        seen[u] += 1
        data_row = items[u].get("where")
        names.append(f"sample {i} of {what}: prompt {u}'s response {seen[u]} of {responses[u]}"
                     + (f", data row {data_row}" if data_row else ""))
    return names


def decode_prompts(tokenizer, batch: RolloutBatch) -> list[str]:
    """Each row's prompt of `batch` as text, for the dumps: the rows of a group (`batch.uids`) share their
    prompt, so each group's is decoded once (the n rows of a prompt decoded n times took 16x the time)."""
    first: dict[int, int] = {}
    for i, u in enumerate(batch.uids):
        first.setdefault(u, i)
    texts = dict(zip(first, decode_batch(tokenizer, [batch.prompts[i] for i in first.values()])))
    return [texts[u] for u in batch.uids]


def group_varies(values: np.ndarray) -> bool:
    """Whether dynamic sampling keeps a prompt's group of metric `values`: one response, or values not all
    equal. verl's recipe tests `np.std(values) > 0`, which a group of equal values can pass by rounding
    (`np.std([0.1] * 3)` is 1.4e-17): a group with nothing to learn from, kept."""
    return len(values) == 1 or float(np.max(values)) > float(np.min(values))


def _dump_row(batch: RolloutBatch, i: int, text_in: str, text_out: str, step: int, score: float, extras: dict,
              others: dict, **figures) -> dict:
    """Sample `i` of `batch` as a line of a rollout or validation dump (verl's `input`, `output`,
    `gts`, `score`, then `figures`: a rollout's `reward` and `advantage`), with its data source,
    length, finish reason, step, turns (multi-turn) and the reward function's extra keys."""
    row = {"input": text_in, "output": text_out, "gts": batch.ground_truths[i], "score": score, **figures,
           "data_source": batch.data_sources[i], "response_length": len(batch.responses[i]),
           "finish_reason": batch.finish_reasons[i], "step": step}
    if batch.num_turns is not None:
        row["num_turns"] = batch.num_turns[i]
    row.update(_dump_extras(extras, others))
    return row


def validation_dump_rows(batch: RolloutBatch, inputs: list[str], outputs: list[str], step: int, scores: list[float],
                         extras: dict[str, list], others: dict[str, list]) -> list[dict]:
    """A validation chunk's samples as lines of `trainer.validation_data_dir`'s dump: `_dump_row`'s,
    with the score also as `reward`, as verl writes it (its validation's `reward` variable, dumped)."""
    return [_dump_row(batch, i, inputs[i], outputs[i], step, scores[i], {k: v[i] for k, v in extras.items()},
                      {k: v[i] for k, v in others.items()}, reward=scores[i])
            for i in range(len(outputs))]


def _dump_extras(numeric: dict[str, float], others: dict) -> dict:
    """One sample's reward-function extras as a dump writes them: the numeric columns (NaN where
    the sample gave none), then the other extras as the function returned them. None among those
    (the sample did not return the key, or, in training, its rank's samples gave only numbers for
    it) leaves a number in place."""
    return {**numeric, **{k: v for k, v in others.items() if v is not None or k not in numeric}}


class PPOTrainer:
    def __init__(self, cfg: PPOConfig, ctx: DistContext):
        self.cfg, self.ctx = cfg, ctx
        validate(cfg, ctx.world_size)
        t = cfg.trainer
        if t.nnodes * t.n_gpus_per_node not in (ctx.world_size, 1):
            raise ConfigError(f"trainer.nnodes x trainer.n_gpus_per_node = {t.nnodes * t.n_gpus_per_node} but "
                              f"the launch has {ctx.world_size} processes")
        _seed_everything(t.seed)
        if any(fc.full_determinism for fc in full_determinism_sections(cfg).values()):
            enable_full_determinism()
        self.device = ctx.device
        self.run_dir = t.default_local_dir
        self.timer = Timer(self.device)

        from data import PromptDataLoader, RLHFDataset

        self.tokenizer = load_actor_tokenizer(cfg)
        d = cfg.data
        from rewards import BUILTIN_DATA_SOURCES, load_reward_manager
        from rewards.managers import PRIME_PROCESSES

        # Rows the reward function scores need a ground truth, and the built-in scorers a data
        # source they know: both checked at load, naming the row, not after the first generation.
        rm_cfg = cfg.reward_model
        rule = not rm_cfg.enable or rm_cfg.combine == "add"
        # the reward model, checked before any data or model loads; with its own chat rendering
        # (verl's default) every prompt must be chat messages, checked as the rows load
        self.rm_inputs = (reward_model_inputs(rm_cfg, self.tokenizer, cfg.actor_rollout_ref.model.path)
                          if rm_cfg.enable else None)
        chat_prompts_for = None if self.rm_inputs is None else (
            "reward_model.model.input_tokenizer is set (verl's default), so the reward model reads each prompt's "
            "messages and the response rendered with its own chat template; store chat messages, or set "
            "reward_model.model.input_tokenizer=null to give it the actor's token ids")
        tools, interactions = self._load_tools()
        # verl's sampler with data.seed null draws from an unseeded torch.Generator: its fixed default seed
        seed = torch.Generator().initial_seed() if d.seed is None else d.seed
        ds_kw = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                     filter_overlong_prompts=d.filter_overlong_prompts, truncation=d.truncation,
                     apply_chat_template=d.apply_chat_template,
                     # the built-in scorers read the ground truth; a custom function gets what the row has
                     # (None where it has none, as verl's managers pass it)
                     apply_chat_template_kwargs=d.apply_chat_template_kwargs,
                     require_ground_truth=rule and not cfg.custom_reward_function.path,
                     data_sources=BUILTIN_DATA_SOURCES if rule and not cfg.custom_reward_function.path else None,
                     chat_prompts_for=chat_prompts_for, media_keys=d.media_keys,
                     default_agent=cfg.actor_rollout_ref.rollout.agent.default_agent_loop,
                     tool_schemas=[t.tool_schema for t in tools], shuffle=d.shuffle, seed=seed,
                     across_ranks=True)  # each rank tokenizes its share of the prompts
        self.train_ds = RLHFDataset(d.train_files, self.tokenizer, max_samples=d.train_max_samples, **ds_kw)
        self.val_ds = (RLHFDataset(d.val_files, self.tokenizer, max_samples=d.val_max_samples, **ds_kw)
                       if d.val_files else None)
        self.agent_loop = self._tool_agent(tools, interactions)
        for key in ("train_batch_size", "gen_batch_size"):
            if len(self.train_ds) < getattr(d, key):
                raise ConfigError(f"data.{key} ({getattr(d, key)}) is larger than the training set "
                                  f"({len(self.train_ds)} prompts after filtering)")
        # rounds of gen_batch_size prompts (train_batch_size unless dynamic sampling asks for more)
        # verl's loader with worker processes draws its sampler's permutation twice an epoch (the second is used)
        self.loader = PromptDataLoader(self.train_ds, d.gen_batch_size, shuffle=d.shuffle, seed=seed,
                                       draws_per_epoch=2 if d.dataloader_num_workers > 0 else 1)
        # an epoch is the training set's train_batch_size batches, as verl 0.9.1 counts it, however many
        # prompts dynamic sampling's rounds draw (the loader goes on into the next epoch's if need be)
        self.total_steps = t.total_training_steps or len(self.train_ds) // d.train_batch_size * t.total_epochs
        self.profiler = StepProfiler(profile_plan(cfg), ctx.rank, self.device, self.total_steps, log=self.log)
        self.timer.around = self.profiler.phase
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # the reward file is the user's input too: checked before any model loads
        crf = cfg.custom_reward_function
        # prime's worker processes: verl's pool size, within this rank's share of the machine's cores
        cores = max(1, len(os.sched_getaffinity(0)) // ctx.local_world_size)
        self.reward_manager = load_reward_manager(
            rm_cfg.reward_manager, crf.path, crf.name, crf.reward_kwargs, rm_cfg.manager_kwargs(),
            eos_token=self.tokenizer.eos_token, processes=min(PRIME_PROCESSES, cores),
            warn=lambda text: say(f"meshppo: warning (rank {ctx.rank}): {text}"),
            experiment_name=cfg.trainer.experiment_name)

        self.models = build_models(cfg, ctx, self.total_steps, self.tokenizer)
        self.peaks = PeakMemory(self.device)
        self._build_roles()
        self.engine = build_engine(cfg, ctx, self.models)
        self.rollout = build_rollout(cfg, self.models, self.actor, self.engine, ctx.rank, self.peaks, self.timer)
        kc = cfg.algorithm.kl_ctrl
        self.kl = KLCoefficients(in_reward=get_kl_controller(kc.type, kc.kl_coef, kc.target_kl, kc.horizon),
                                 in_loss=FixedKLController(cfg.actor_rollout_ref.actor.kl_loss_coef))
        self.guard = KLGuard(cfg.algorithm.kl_guard)
        self.global_step = 0
        self.nonfinite_streak = 0
        m = self.models
        states = {"trainer": self, "loader": self.loader, "kl": self.kl, "kl_guard": self.guard,
                  "actor_sched": m.actor_sched}
        models = {"actor": (m.actor, m.actor_optim)}
        if m.critic is not None:
            states["critic_sched"] = m.critic_sched
            models["critic"] = (m.critic, m.critic_optim)
        self.ckpt = CheckpointManager(
            os.path.join(self.run_dir, "checkpoints"), states=states, models=models,
            extras={"actor_sched": "actor", "critic_sched": "critic"},
            fingerprint=m.actor_args.fingerprint, config=cfg,
            tokenizer=self.tokenizer, base_model=cfg.actor_rollout_ref.model.path, rank=ctx.rank,
            world_size=ctx.world_size, keep=t.max_actor_ckpt_to_keep, log=self.log)
        self._stop_signal, self._stop_time, self._last_update_s = None, 0.0, 0.0
        self._update_work = np.zeros(3)  # what the last actor update ran (`Role.count_work`)
        self._critic_work = np.zeros(3)  # and the last critic update
        self._infer_work = np.zeros(3)  # and the last old-log-prob pass
        self.tracking = Tracking(t.logger, self.run_dir, t.project_name, t.experiment_name,
                                 dataclasses.asdict(cfg), self.total_steps, enabled=ctx.is_main)
        note = last_step_note(cfg, self.total_steps)  # listed steps after the last
        if note:
            self.log(f"meshppo: {note}")

    def _build_roles(self) -> None:
        """The actor, and the reference, critic and reward model when the config uses them; each
        with its micro-batching and memory placement (a role whose states are offloaded starts
        in host memory)."""
        cfg, m = self.cfg, self.models
        arr = cfg.actor_rollout_ref
        common = dict(device=self.device, pad_token_id=self.pad_id)
        policy = dict(common, packed=arr.model.use_remove_padding, share_prefix=arr.actor.use_prefix_grouper,
                      temperature=arr.rollout.decoding_temperature() or 1.0)
        trainable = dict(world_size=self.ctx.world_size, response_length=cfg.response_length)
        lp = arr.rollout
        self.actor = Actor(m.actor, m.actor_optim, m.actor_sched, **policy, **trainable,
                           router_replay=arr.actor.router_replay.mode,
                           fsdp_cfg=arr.actor.fsdp_config, sp=m.actor_sp,
                           batching=MicroBatching(lp.log_prob_micro_batch_size_per_gpu, lp.log_prob_use_dynamic_bsz,
                                                  lp.log_prob_max_token_len_per_gpu))
        self.ref: Reference | None = None
        rc = arr.ref
        ref_batching = MicroBatching(rc.log_prob_micro_batch_size_per_gpu, rc.log_prob_use_dynamic_bsz,
                                     rc.log_prob_max_token_len_per_gpu)
        if m.ref is not None:
            self.ref = ReferencePolicy(m.ref, **policy, fsdp_cfg=rc.fsdp_config, batching=ref_batching, sp=m.actor_sp)
        elif cfg.uses_ref:  # a LoRA actor (setup.build_models built no reference model)
            self.ref = AdaptersOffReference(self.actor, ref_batching)
        self.critic = None
        if m.critic is not None:
            cc = cfg.critic
            self.critic = Critic(m.critic, m.critic_optim, m.critic_sched, **common, **trainable,
                                 packed=cc.model.use_remove_padding, fsdp_cfg=cc.model.fsdp_config, sp=m.critic_sp,
                                 batching=MicroBatching(cc.forward_micro_batch_size_per_gpu, cc.use_dynamic_bsz,
                                                        cc.forward_max_token_len_per_gpu))
        self.reward_model = None
        if m.reward_model is not None:
            rm = cfg.reward_model
            # its own token ids are padded with its own tokenizer's pad (the actor's may be outside its vocabulary)
            pad = common["pad_token_id"] if self.rm_inputs is None else (self.rm_inputs.rm.pad_token_id or 0)
            self.reward_model = RewardModel(m.reward_model, device=self.device, pad_token_id=pad,
                                            inputs=self.rm_inputs, packed=rm.model.use_remove_padding,
                                            fsdp_cfg=rm.model.fsdp_config, sp=m.reward_model_sp,
                                            batching=MicroBatching(rm.micro_batch_size_per_gpu, rm.use_dynamic_bsz,
                                                                   rm.forward_max_token_len_per_gpu))

    def _load_tools(self) -> tuple[list, dict]:
        """The tools of `rollout.multi_turn.tool_config_path` and the interactions of its
        `interaction_config_path` (none without multi-turn), loaded and checked before any data or model."""
        mt = self.cfg.actor_rollout_ref.rollout.multi_turn
        if not mt.enable:
            return [], {}
        from agent.interactions import InteractionConfigError, load_interactions
        from agent.tools import ToolConfigError, load_tools

        key = "actor_rollout_ref.rollout.multi_turn"
        try:
            tools = load_tools(mt.tool_config_path) if mt.tool_config_path is not None else []
        except ToolConfigError as e:
            raise ConfigError(f"{key}.tool_config_path: {e}") from None
        try:
            interactions = (load_interactions(mt.interaction_config_path) if mt.interaction_config_path is not None
                            else {})
        except InteractionConfigError as e:
            raise ConfigError(f"{key}.interaction_config_path: {e}") from None
        return tools, interactions

    def _tool_agent(self, tools: list, interactions: dict):
        """The multi-turn loop (`agent.loop.ToolAgent`) when `rollout.multi_turn.enable`, else None;
        either way the datasets' rows must agree with the switch: a row that runs the tool agent
        needs it on, and with it on some training row must (else every tool option is ignored);
        with interactions, every tool-agent row must name one (`extra_info.interaction_kwargs.name`)."""
        r = self.cfg.actor_rollout_ref.rollout
        counts = [(name, ds.count_agents()) for name, ds in (("data.train_files", self.train_ds),
                                                            ("data.val_files", self.val_ds)) if ds is not None]
        if not r.multi_turn.enable:
            for name, c in counts:
                if c[TOOL_AGENT]:
                    raise ConfigError(f"{name}: {c[TOOL_AGENT]} row(s) run the tool agent (agent_name tool_agent or "
                                      "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent) but "
                                      "actor_rollout_ref.rollout.multi_turn.enable is false")
            return None
        if not counts[0][1][TOOL_AGENT]:
            raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable=true but no row of data.train_files runs "
                              "the tool agent: give the rows agent_name tool_agent or set "
                              "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent")
        if interactions:
            for ds in (self.train_ds, self.val_ds):
                for it in ds or []:
                    kwargs = it["extra_info"].get("interaction_kwargs")
                    if it["agent_name"] == TOOL_AGENT and (not isinstance(kwargs, dict)
                                                           or kwargs.get("name") not in interactions):
                        raise ConfigError(
                            f"{it['where']}: extra_info.interaction_kwargs must name one of the "
                            f"interactions of actor_rollout_ref.rollout.multi_turn.interaction_config_path "
                            f"({sorted(interactions)}) with 'name'; got {kwargs!r}")
        from agent.loop import ToolAgent
        from agent.tools import ChatTemplateError

        mt = r.multi_turn
        try:
            # renders a sample tool / user message: a template that cannot is refused before any model work
            return ToolAgent(self.tokenizer, tools, response_length=self.cfg.response_length,
                             max_assistant_turns=mt.max_assistant_turns, max_user_turns=mt.max_user_turns,
                             max_parallel_calls=mt.max_parallel_calls,
                             max_tool_response_length=mt.max_tool_response_length,
                             tool_response_truncate_side=mt.tool_response_truncate_side, format=mt.format,
                             chat_template_kwargs=self.cfg.data.apply_chat_template_kwargs, interactions=interactions,
                             # a look at the waiting samples is a broadcast over the engine's TP group
                             poll_every=1 if r.tensor_model_parallel_size == 1 else TP_POLL_STEPS)
        except ChatTemplateError as e:
            key, path, what = (("tool_config_path", mt.tool_config_path, "the tools' answers as 'tool' messages")
                               if e.role == "tool" else
                               ("interaction_config_path", mt.interaction_config_path,
                                "the interactions' replies as 'user' messages"))
            raise ConfigError(f"actor_rollout_ref.rollout.multi_turn.{key}={path!r}: the turns append {what}, "
                              f"rendered by the chat template of the tokenizer {self.cfg.data.tokenizer!r} "
                              "(data.tokenizer / actor_rollout_ref.model.path; actor_rollout_ref.model."
                              f"custom_chat_template replaces it), but {e}") from None

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "nonfinite_streak": self.nonfinite_streak}

    def load_state_dict(self, state: dict) -> None:
        self.global_step, self.nonfinite_streak = state["global_step"], state["nonfinite_streak"]

    # ------------------------------------------------------------------ helpers
    def _eos_ids(self) -> list[int]:
        """The ids that end a response, for every consumer (engine and HF rollouts, hence the
        response masks and finish reasons): every EOS id of the actor checkpoint's config.json and
        generation_config.json (instruct models list several; Hugging Face and the CLI stop at all
        of them), plus the tokenizer's. Empty only if none names one: the engine's model default
        then applies."""
        from models import load_model_args
        from rollout.generate import model_eos_ids

        model = self.cfg.actor_rollout_ref.model
        model_dir = Path(model.path)
        try:
            return model_eos_ids(model_dir, load_model_args(model_dir, model.override_config).eos_token_id,
                                 self.tokenizer)
        except ValueError as e:  # an unreadable generation_config.json
            raise UserError(f"actor_rollout_ref.model.path: {e}") from None

    def log(self, text: str):
        self.tracking.message(text)

    def _install_signal_handlers(self):
        def handler(signum, frame):
            # The first signal starts the grace period: a later one (USR1, then the scheduler's TERM; the
            # launcher forwarding a repeated signal) must not move the deadline past the scheduler's kill.
            if self._stop_signal is None:
                self._stop_signal, self._stop_time = signum, time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, handler)

    def _agreed_stop_signal(self) -> bool:
        """True on every rank if any rank received SIGTERM/SIGUSR1 (so all stop at the same step)."""
        return comm.all_reduce_values([1.0 if self._stop_signal is not None else 0.0], "max")[0] > 0

    def _check_abandon(self) -> None:
        """Before the first update of a step: if any rank was signalled and the updates (timed on
        the previous step) would end after the grace period, every rank abandons the step. Both
        times are agreed (the largest rank's), so every rank takes the same branch."""
        since = time.monotonic() - self._stop_time if self._stop_signal is not None else -1.0
        since, last_update_s = comm.all_reduce_values([since, self._last_update_s], "max")
        if since < 0:
            return
        if since + last_update_s > self.cfg.trainer.preemption_grace_s:
            raise _AbandonStep()

    # ------------------------------------------------------------------ rollouts
    def _sampling(self, validate: bool):
        r = self.cfg.actor_rollout_ref.rollout
        s = r.val_kwargs if validate else r
        return dict(n=s.n, temperature=r.decoding_temperature(validate), top_p=s.top_p, top_k=s.top_k)

    def _generate_all(self, items: list[dict], validate: bool, seed: int, sampling: dict | None = None) -> RolloutBatch:
        """Generate for every prompt of `items` (split over rollout-DP groups), gather all
        outputs on every rank, and return them as (not yet partitioned) rollouts. `sampling`
        replaces the training (or validation) sampling settings."""
        sp = sampling or self._sampling(validate)
        agent = None
        if self.agent_loop is not None:
            agent = AgentRows(self.agent_loop, [it["agent_name"] for it in items], [it["tools_kwargs"] for it in items],
                              [it["raw_prompt"] for it in items],
                              [it["extra_info"].get("interaction_kwargs") for it in items],
                              [it["tool_selection"] for it in items])
        outs = self.rollout.generate([it["input_ids"] for it in items], max_tokens=self.cfg.response_length,
                                     eos_ids=self.eos_ids, ignore_eos=self.cfg.actor_rollout_ref.rollout.ignore_eos,
                                     seed=seed, agent=agent, **sp)
        # every row's prompt ids from `items` (the engine's samples do not carry them): sample k of prompt i is row i * n + k
        uids = np.repeat(np.arange(len(items)), sp["n"]).tolist()
        prompts = Ragged.of([it["input_ids"] for it in items], np.int32).take(uids)
        width = int(outs.token_ids.lengths().max(initial=1)) or 1
        rep = lambda key: [items[u][key] for u in uids]  # noqa: E731
        extra_infos = rep("extra_info")
        if agent is not None:
            turns = outs.turns
            # verl's reward managers see the turns in extra_info: num_turns, and the tools' rewards
            extra_infos = [{**e, "num_turns": count, "tool_rewards": rewards, "turn_scores": scores}
                           for e, count, rewards, scores in zip(extra_infos, turns["num_turns"], turns["tool_rewards"],
                                                                turns["turn_scores"])]
            # verl's agent-loop timings: per sample, the seconds its turns spent in the engine and
            # waiting for its tools (and interaction), over every sample of the batch
            for name, times in (("generate_sequences", turns["generate_s"]), ("tool_calls", turns["tool_s"])):
                if times:
                    for stat, value in (("min", min(times)), ("max", max(times)), ("mean", sum(times) / len(times))):
                        self.timer.set(f"agent_loop/{name}/{stat}", value)
        return RolloutBatch(prompts, outs.token_ids, uids, rep("data_source"), rep("ground_truth"), extra_infos,
                            outs.finish_reasons, outs.logprobs, width, self.device, raw_prompts=rep("raw_prompt"),
                            turn_masks=outs.masks, num_turns=None if agent is None else outs.turns["num_turns"],
                            routed_experts=outs.routed_experts)

    def _greedy_baselines(self, items: list[dict], full: RolloutBatch) -> torch.Tensor | None:
        """`remax`'s baselines, as verl makes them: one greedy response per prompt (timed as
        `gen_max`), scored like the step's samples (without KL), each row of `full` given its
        prompt's score, `[N]` on every rank; each greedy response is scored once over the ranks
        (`_score_spread`). None for the other estimators."""
        if self.cfg.algorithm.adv_estimator != "remax":
            return None
        with self.timer("gen_max"):
            greedy = self._generate_all(items, validate=False, seed=0,
                                        sampling=dict(n=1, temperature=0.0, top_p=1.0, top_k=-1))
            greedy.row_names = reward_row_names(greedy, items, "the step's greedy responses (remax)")
            scores, _, _ = self._score_spread(greedy)
        return scores[torch.tensor(full.uids, device=scores.device)]

    def _score_spread(self, ro: RolloutBatch, texts: list[str] | None = None,
                      with_extras: bool = False) -> tuple[torch.Tensor, dict, dict]:
        """`_score` of rows that every rank holds (`ro`, `texts`: their decoded responses, if at hand),
        each row scored once over the ranks: each rank scores its share (`_partition`) and the shares
        are gathered, so the reward function and the reward model do not run on every row on every
        rank. The rows need not divide over the ranks: they are padded to a multiple of the world size
        with copies of the first ones, scored and dropped, so that every rank scores equally many
        rows (a reward model with a fixed micro-batch size runs as many forwards, FSDP's
        collectives, on each; a reward function may see a row twice). Returns the scores `[N]` on
        every rank and, with `with_extras`, the reward function's numeric extras (NaN where a row
        gave none) and its other extras (None where a row gave none), lists in the rows' order;
        else two empty dicts."""
        n, w = len(ro), self.ctx.world_size
        padded = math.ceil(n / w) * w
        local, parts = self._partition(ro.take([i % n for i in range(padded)]))
        mine = None if texts is None else [texts[i % n] for i in parts[self.ctx.rank]]
        scores, numeric, others, _ = self._score(local, mine)
        names = list(numeric)  # the same on every rank (`_agreed_extras`)
        cols = torch.stack([scores.double()] + [torch.tensor(numeric[k], dtype=torch.float64, device=self.device)
                                               for k in names], dim=1)
        cols = self._gather_rows(cols, parts, padded)[:n]
        if not with_extras:
            return cols[:, 0].float(), {}, {}
        others = {k: v[:n] for k, v in self._gather_other_extras(others, parts, padded).items()}
        return cols[:, 0].float(), {k: cols[:, 1 + j].tolist() for j, k in enumerate(names)}, others

    def _partition(self, ro: RolloutBatch, train: bool = False) -> tuple[RolloutBatch, list[list[int]]]:
        """This rank's share of the rollouts and every rank's row indices (`partition_rows`): each
        rank computes the same partition, so none is communicated. `train` (the rows the step trains
        on): balanced over the actor's data-parallel groups, its Ulysses groups (verl's dp size), and
        under prefix sharing (`actor.use_prefix_grouper`) each prompt's rows kept in one group where
        the prompt groups allow it, so that they can share it; else (rows that are only scored)
        balanced over the ranks, each of which scores its own."""
        group = self.actor.sp_size if train else 1
        parts = partition_rows(ro, self.ctx.world_size, group, self.cfg.trainer.balance_batch,
                               train and self.actor.share_prefix)
        return ro.take(parts[self.ctx.rank]), parts

    def _gather_rows(self, t: torch.Tensor, parts: list[list[int]], n_total: int) -> torch.Tensor:
        """Rebuild the full `[N, ...]` tensor from every rank's rows (`parts[k]`: rank k's rows)."""
        full = torch.zeros((n_total,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        for p, ix in zip(comm.all_gather(t), parts):
            full[ix] = p
        return full

    # ------------------------------------------------------------------ rewards
    def _score(self, ro: RolloutBatch, texts: list[str] | None = None) -> tuple[torch.Tensor, dict, dict, torch.Tensor]:
        """Scores `[N]` of the rows `ro` (`texts`: their decoded responses, if already at hand; a
        reward function's error names a row by `ro.row_names`, its place in the whole batch) from
        the rule / custom function (called by `reward_model.reward_manager`), the reward model or
        both (`reward_model.combine`), the function's numeric extra columns (the same keys on every
        rank), its other extras (this rank's rows' own keys, for the dumps), and the function's own
        scores `[N]` (before the manager's additions, DAPO's overlong penalty, and without the
        reward model's; the reward model's where it scores alone). A failing reward function fails
        every rank together (an error on one rank would otherwise hang the rest)."""
        from rewards import RewardError

        texts = decode_batch(self.tokenizer, ro.responses) if texts is None else texts
        err, scores, extras, others, own = None, None, {}, {}, None
        rm_cfg = self.cfg.reward_model
        use_rule = not rm_cfg.enable or rm_cfg.combine == "add"
        if use_rule:
            try:
                scores, extras, others, own = self.reward_manager.score(
                    ro.data_sources, texts, ro.ground_truths, ro.extra_infos, ro.responses.lengths().tolist(),
                    ro.row_names)
            except RewardError as e:
                err = str(e)
        rm_batch = None
        if rm_cfg.enable and err is None:
            from jinja2 import TemplateError

            try:  # the reward model's chat template may refuse a row (a system message, say): this rank's rows only
                rm_batch = self.reward_model.model_batch(ro)
            except (TemplateError, ValueError, TypeError, KeyError) as e:  # (what a template or a row raises)
                err = (f"the reward model's input (each chat rendered with reward_model.model.path's chat template, "
                       f"responses decoded with reward_model.model.input_tokenizer) failed: {type(e).__name__}: {e}")
        self._fail_together(err)
        out = torch.tensor(scores if scores is not None else [0.0] * len(ro), dtype=torch.float32,
                           device=self.device)
        if rm_cfg.enable:
            out = out + self.reward_model.scores(rm_batch)
        own = out if own is None else torch.tensor(own, dtype=torch.float32, device=self.device)
        return out, self._agreed_extras(extras, len(ro)), others, own

    def _agreed_log(self, write) -> None:
        """`write` (rank 0's: the run's start, a metrics row, a dump; None where a rank writes nothing) agreed
        on every rank: its failure (a UserError naming the file or logger: a full disk, a quota, wandb's start)
        stops every rank together, where rank 0 raising alone left the others in their next collective."""
        agreed_user_error(write, lambda rank: f"rank {rank} could not write the run's logs (its error says which "
                                              "and why)")

    def _begin_logs(self) -> None:
        """The run's logs start (`Tracking.begin`: the run directory's files, TensorBoard, the wandb
        run), agreed as every later write of rank 0's (`_agreed_log`)."""
        info = run_info(self.device, self.ctx.world_size, self.ctx.local_world_size, self.models.dims,
                        self.run_dir, self.global_step, self.models.ulysses_sizes())
        self._agreed_log(functools.partial(self.tracking.begin, self.global_step, to_commented_yaml(self.cfg), info))

    def _log_row(self, metrics: dict) -> None:
        """This step's row of `metrics` in the run's logs (`trainer.logger`), agreed (`_agreed_log`)."""
        self._agreed_log(functools.partial(self.tracking.log, metrics, step=self.global_step))

    def _fail_together(self, err: str | None) -> None:
        """If this or any rank hit an error (`err`: this rank's message or None), every rank raises
        the first failing rank's message together; one rank raising alone would leave the others
        waiting in their next collective, with nothing to say but that it failed."""
        if not comm.all_reduce_values([1.0 if err else 0.0], "max")[0]:
            return
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, err)
            err = next(f"(on rank {r}) {e}" if r != self.ctx.rank else e for r, e in enumerate(every) if e)
        raise UserError(err)

    @staticmethod
    def _agreed_extras(extras: dict[str, list[float]], rows: int) -> dict[str, list[float]]:
        """The reward function's extra columns with every rank's names, in sorted order (NaN where
        this rank's samples gave none): the metrics and dumps reduce them key by key, so every rank
        must see the same keys in the same order."""
        names = sorted(extras)
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, names)
            names = sorted(set().union(*every))
        return {k: extras.get(k, [math.nan] * rows) for k in names}

    # ------------------------------------------------------------------ the step
    def step(self) -> dict:
        """One PPO step, each phase one call in the order of docs/ARCHITECTURE.md. The phases fill
        the optional fields of this rank's `RolloutBatch` and add their metrics."""
        metrics = {}
        faults.at_step_start(self.global_step + 1, self.ctx.rank)
        items = self.loader.next_batch()
        # the step's garbage collection (on leaving `collect_after`) is part of the step's time
        with self.timer("step"), gc_control.collect_after(self.global_step + 1):
            seed = self.cfg.trainer.seed * 1_000_003 + self.global_step
            baselines = None
            if self.cfg.algorithm.filter_groups.enable:
                full, ro, parts, scores, extras = self._filtered_rollouts(items, seed, metrics)
            else:
                with self.timer("gen"):
                    full = self._generate_all(items, validate=False, seed=seed)
                full.row_names = reward_row_names(full, items, "the step's batch")
                baselines = self._greedy_baselines(items, full)
                ro, parts = self._partition(full, train=True)
                scores, extras = self._reward(ro)
            if self.cfg.trainer.balance_batch:  # the balance of the batch the step trains on (before a PF-PPO redraw)
                metrics.update(seqlen_balance_metrics(full.lengths(), parts, self.actor.sp_size))
            self._old_log_probs(full, ro, parts, metrics)
            self._ref_log_probs(ro, metrics)
            self._values(ro)
            self._compute_advantages(full, ro, parts, metrics, baselines)
            if self.cfg.algorithm.use_pf_ppo:
                full, ro, parts, scores, extras = self._pf_ppo_redraw(full, ro, parts, scores, extras, seed)
            full.drop_tensors()  # each rank holds its rows' tensors: the whole batch's go before the updates
            self._check_abandon()
            t_update = time.perf_counter()
            self._update_critic(ro, metrics)
            self._update_actor(ro, metrics)
            self._last_update_s = time.perf_counter() - t_update
            if self.device.type == "cuda":
                metrics["perf/max_memory_allocated_update_gb"] = self.peaks.since_split_gb()
            if self.cfg.trainer.rollout_data_dir:
                with self.timer("dump_rollout_generations"):  # verl's name
                    self._dump_rollouts(full, ro, parts, scores, extras)
        self.global_step += 1
        metrics.update(data_metrics(ro, scores, extras, max_prompt_length=self.cfg.data.max_prompt_length,
                                    max_response_length=self.cfg.response_length))
        if ro.sum_pi_squared is not None:
            metrics.update(variance_proxy_metrics(ro, metrics.get("actor/grad_norm")))
        metrics.update(self.timer.pop())
        metrics.update(self._perf_metrics(ro, metrics))
        if self.cfg.actor_rollout_ref.actor.use_kl_loss:
            metrics["actor/kl_coef"] = self.kl.in_loss.value
        return metrics

    def _reward(self, ro: RolloutBatch) -> tuple[torch.Tensor, dict]:
        """Scores `[N_local]` and the reward function's numeric extra columns; `ro.token_level_scores`
        holds each score on its response's last token, `ro.other_extras` the function's other
        extras (for the dumps), `ro.reward_components` gdpo's components."""
        with self.timer("reward"):
            scores, extras, ro.other_extras, _ = self._score(ro)
        self._place_scores(ro, scores)
        self._place_components(ro, extras)
        return scores, extras

    def _place_scores(self, ro: RolloutBatch, scores: torch.Tensor) -> None:
        """`ro.token_level_scores`: each score `[N_local]` on its response's last token."""
        token_scores = torch.zeros(len(ro), ro.width, device=self.device)
        last = torch.from_numpy(ro.responses.lengths() - 1).to(self.device).clamp(min=0)
        token_scores[torch.arange(len(ro), device=self.device), last] = scores
        ro.token_level_scores = token_scores

    def _place_components(self, ro: RolloutBatch, extras: dict[str, list[float]]) -> None:
        """gdpo's `ro.reward_components` `[N_local, K]`, float32: each row's numbers under the reward
        function's `algorithm.gdpo_reward_keys`, from its numeric extras `extras` (its dict result's
        entries, a plain score's `acc`: verl reads its reward extras so), NaN where a row gave none
        (`_gdpo_inputs` refuses it). Nothing for the other estimators."""
        alg = self.cfg.algorithm
        if alg.adv_estimator != "gdpo":
            return
        none = [math.nan] * len(ro)
        ro.reward_components = torch.stack([torch.tensor(extras.get(key, none), dtype=torch.float32, device=self.device)
                                            for key in alg.gdpo_reward_keys], dim=1)

    def _filtered_rollouts(self, items: list[dict], seed: int, metrics: dict):
        """DAPO's dynamic sampling (`algorithm.filter_groups`): generate rounds of
        `data.gen_batch_size` prompts (the first round's seed is the unfiltered step's), score each
        round's rows on the ranks that own them, and keep the prompts whose responses' metric varies
        (population std > 0, or a single response), until `data.train_batch_size` prompts are kept;
        then the first `train_batch_size` kept prompts, in the rounds' order, are the step's batch
        (verl's recipe: `batch[:train_batch_size * n]`). Fails after
        `max_num_gen_batches` rounds (if > 0) that kept too few. Returns what the unfiltered path has
        at this point: `(full, ro, parts, scores, extras)`, with the scores and extras of the kept
        rows, not scored again. `train/num_gen_batches` counts the rounds; as verl 0.9.1's default trainer
        logs them (where not 0), `training/filter_groups/evicted_samples` counts the prompts dropped for
        a metric that did not vary and `training/filter_groups/discarded_surplus_samples` the varying
        prompts beyond `train_batch_size`, over the step's rounds (prompts, for all the names say)."""
        fg, target = self.cfg.algorithm.filter_groups, self.cfg.data.train_batch_size
        kept: list[tuple[RolloutBatch, torch.Tensor, list[str], dict]] = []  # each round's kept rows
        prompts, rounds, dropped = 0, 0, np.zeros(2, dtype=np.int64)  # (evicted, surplus) prompts
        while True:
            rounds += 1
            rows, groups, counts = self._filter_round(items, seed if rounds == 1 else derive_seed(seed, rounds - 1), rounds,
                                              target - prompts)
            dropped += counts
            kept.append(rows)
            prompts += groups
            if prompts >= target:
                break
            if 0 < fg.max_num_gen_batches <= rounds:
                raise UserError(f"algorithm.filter_groups: {rounds} generation rounds of data.gen_batch_size="
                                f"{len(items)} prompts kept {prompts} of the {target} a step needs (the others' "
                                f"responses all had the same {fg.metric}); raise "
                                "algorithm.filter_groups.max_num_gen_batches or data.gen_batch_size, or check the data")
            items = self.loader.next_batch()
        metrics["train/num_gen_batches"] = float(rounds)
        for name, count in zip(("evicted_samples", "discarded_surplus_samples"), dropped.tolist()):
            if count:
                metrics[f"training/filter_groups/{name}"] = float(count)
        full = RolloutBatch.concat([b for b, *_ in kept])
        # the extras of every round under one set of names (a round's samples may have given fewer keys)
        names = sorted(set().union(*(n for _, _, n, _ in kept)))
        cols = torch.cat([torch.cat([c[:, :1]] + [c[:, 1 + n.index(k)][:, None] if k in n
                                                  else torch.full((len(c), 1), math.nan, dtype=c.dtype)
                                                  for k in names], dim=1) for _, c, n, _ in kept])
        others = {k: [v for _, c, _, o in kept for v in (o[k] if k in o else [None] * len(c))]
                  for k in sorted(set().union(*(o for *_, o in kept)))}
        ro, parts = self._partition(full, train=True)
        mine = parts[self.ctx.rank]
        local = cols[mine]
        scores = local[:, 0].to(device=self.device, dtype=torch.float32)
        extras = {k: local[:, 1 + j].tolist() for j, k in enumerate(names)}
        ro.other_extras = {k: [v[i] for i in mine] for k, v in others.items()}
        self._place_scores(ro, scores)
        self._place_components(ro, extras)
        return full, ro, parts, scores, extras

    def _filter_round(self, items: list[dict], seed: int, round_: int, wanted: int) -> tuple[tuple, int, np.ndarray]:
        """One generation round of dynamic sampling (`_filtered_rollouts`): `items` generated with `seed`
        and scored on the ranks that own the rows; of the prompts whose responses' metric varies, the
        first `wanted`. Returns their rows alone (the rest of the round is dropped here, so no round's
        whole batch stays alive while later rounds run), as `(rollouts, columns, extra names, other
        extras)` (columns: every kept row's score and numeric extras, on the host; other extras only
        for the dumps), how many prompts they are, and how many it dropped: `[evicted, surplus]` (prompts
        whose metric did not vary; varying ones beyond `wanted`)."""
        with self.timer("gen"):
            batch = self._generate_all(items, validate=False, seed=seed)
        batch.row_names = reward_row_names(batch, items, f"the step's generation round {round_}")
        local, parts = self._partition(batch)
        with self.timer("reward"):
            scores, extras, others, own = self._score(local)
        # every row's score, the function's own and the numeric extras on every rank, in the round's order
        cols = torch.stack([scores.double(), own.double()] + [
            torch.tensor(v, dtype=torch.float64, device=self.device) for v in extras.values()], dim=1)
        cols = self._gather_rows(cols, parts, len(batch)).cpu()
        others = self._gather_other_extras(others, parts, len(batch)) if self.cfg.trainer.rollout_data_dir else {}
        values = self._filter_metric(cols, list(extras), batch)
        groups: dict[int, list[int]] = {}
        for i, u in enumerate(batch.uids):
            groups.setdefault(u, []).append(i)
        varying = [rows for rows in groups.values() if group_varies(values[rows])]
        keep = varying[:wanted]
        counts = np.array([len(groups) - len(varying), len(varying) - len(keep)], dtype=np.int64)
        rows = [i for group in keep for i in group]
        # (the kept rows' columns: score, extras)
        kept_cols = torch.cat([cols[:, :1], cols[:, 2:]], dim=1)[rows]
        return ((batch.take(rows), kept_cols, list(extras), {k: [v[i] for i in rows] for k, v in others.items()}),
                len(keep), counts)

    def _filter_metric(self, cols: torch.Tensor, names: list[str], batch: RolloutBatch) -> np.ndarray:
        """`algorithm.filter_groups.metric` of every row: the score (`seq_reward`, `reward`, verl
        0.9.1's summed reward, and `seq_final_reward`, which without KL in the reward is the score),
        the reward function's own score (`score`: verl's DAPO trainer reads the result's, before the
        overlong penalty) or a numeric extra of the reward function (`cols`: the score, the
        function's own, then the extras `names`, in the rows' order)."""
        metric = self.cfg.algorithm.filter_groups.metric
        if metric in FILTER_GROUP_SEQUENCE_METRICS:
            return cols[:, 1 if metric == "score" else 0].numpy()
        if metric not in names:
            raise UserError(f"algorithm.filter_groups.metric={metric} is not one of the reward function's numeric "
                            f"results ({', '.join(names) or 'it returned none'}) nor "
                            f"{' / '.join(FILTER_GROUP_SEQUENCE_METRICS)}")
        values = cols[:, 2 + names.index(metric)].numpy()
        if np.isnan(values).any():
            row = int(np.flatnonzero(np.isnan(values))[0])
            raise UserError(f"algorithm.filter_groups.metric={metric}: the reward function returned no {metric!r} "
                            f"for a response (data_source={batch.data_sources[row]!r}); every response needs it")
        return values

    def _old_log_probs(self, full: RolloutBatch, ro: RolloutBatch, parts: list[list[int]], metrics: dict) -> None:
        """`old_log_probs`: the actor's recompute (with `actor/entropy`, and `sum_pi_squared` with
        `actor.calculate_sum_pi_squared`; under routing replay R2 its record of each token's experts,
        `routed_experts`), the engine's own in bypass mode, or none where an
        on-policy update makes its own; and rollout correction's pi_old / pi_rollout weights and rejection mask of
        this rank's rows (`rollout_is_weights`, and `rollout_rs_mask`: what `loss_mask` leaves out of the
        advantages, losses and critic from here on; on `full` too, every rank's masks gathered, for the
        advantages over the whole batch), with its `rollout_corr/` metrics and verl's
        `training/rollout_probs_diff_*`, of the whole batch by reductions over the ranks."""
        lp, correction = self.cfg.actor_rollout_ref.rollout, self.cfg.algorithm.rollout_correction
        mask = ro.response_mask
        self._infer_work = np.zeros(3)
        if self.cfg.actor_rollout_ref.actor.router_replay.mode == "R2":
            # R2 replays the routing the pass records (`Actor.log_probs` fills `ro.routed_experts`; PF-PPO's redraw
            # gathers it): the engine's record, where it was taken, is not used
            full.routed_experts = ro.routed_experts = None
        reweighted = correction.rollout_is is not None or bool(correction.rejection)
        if correction.bypass_mode or reweighted or lp.calculate_log_probs:
            ro.rollout_log_probs = ro.padded(ro.engine_log_probs)
        if correction.bypass_mode:
            # The engine's log-probs are the old ones (the same softmax of logits / temperature):
            # no recompute pass. actor/entropy and rollout/logprob_diff come from the update.
            ro.old_log_probs = ro.rollout_log_probs
            return
        with_sps = self.cfg.actor_rollout_ref.actor.calculate_sum_pi_squared
        if (self._on_policy_update() and not reweighted and not lp.calculate_log_probs
                and not self.cfg.algorithm.use_kl_in_reward and not with_sps and not self.cfg.algorithm.use_pf_ppo):
            # One optimizer step on this batch: its ratio's old log-probs are the update's own forward
            # (`Actor.update`), and nothing before it reads them (no KL in the reward, no rollout
            # correction or its diagnostics, no sum of squared probabilities for the advantages), so
            # the recompute pass is skipped. actor/entropy and actor/ref_kl come from the update. Not
            # with PF-PPO: the update trains on the redrawn batch, and verl's actor/entropy is the
            # pass's, of the batch before the redraw.
            return
        with self.timer("old_log_prob"):
            with self.actor.count_work() as work:
                old, ent, *sps = self.actor.log_probs(ro, with_entropy=True, with_sum_pi_squared=with_sps)
            self._infer_work = work
            ro.old_log_probs = old
            ro.sum_pi_squared = sps[0] if with_sps else None
            # verl's: aggregated over the batch with the actor's loss_agg_mode (and loss_scale_factor)
            actor_cfg = self.cfg.actor_rollout_ref.actor
            metrics["actor/entropy"] = agg_loss_global(ent, mask, actor_cfg.loss_agg_mode,
                                                       actor_cfg.loss_scale_factor or self.cfg.response_length)
            if lp.calculate_log_probs:
                metrics["rollout/logprob_diff"] = masked_mean_global((ro.rollout_log_probs - old).abs(), mask)
        if reweighted or lp.calculate_log_probs:
            # pi_old / pi_rollout once per step, each rank on its rows; the metrics (and the batch
            # normalisation) are of the whole batch, from the ranks' reduced sums and maxima
            weights, keep, corr = compute_rollout_correction(
                old, ro.rollout_log_probs, mask, correction.rollout_is, *correction.is_bounds, correction.rejection,
                correction.rollout_is_batch_normalize, comm.all_reduce, global_metrics=True)
            # verl's training/rollout_probs_diff_* and rollout_actor_probs_pearson_corr (logged wherever
            # the batch has rollout log-probs and the old ones are recomputed), over every response token
            corr.update(rollout_probs_diff_metrics(old, ro.rollout_log_probs, mask, comm.all_reduce))
            ro.rollout_is_weights = weights
            if keep is not None:
                ro.rollout_rs_mask = keep
                # the advantages are over the whole batch's loss mask: the ranks' masks, a byte a token
                full.rollout_rs_mask = self._gather_rows(keep.bool(), parts, len(full)).to(keep.dtype)
            metrics.update(zip(corr, torch.stack([v.double() for v in corr.values()]).tolist()))

    def _on_policy_update(self) -> bool:
        """Whether this step's actor update is a single optimizer step on the batch (one
        mini-batch, one epoch, after the critic's warm-up): verl's `on_policy`."""
        actor_cfg = self.cfg.actor_rollout_ref.actor
        return (self.cfg.data.train_batch_size == actor_cfg.ppo_mini_batch_size and actor_cfg.ppo_epochs == 1
                and self.global_step >= self.cfg.trainer.critic_warmup)

    def _ref_log_probs(self, ro: RolloutBatch, metrics: dict) -> None:
        """`ref_log_probs` from the reference role, and `actor/ref_kl` (from the update where the
        old log-probs were skipped, see `_old_log_probs`)."""
        if self.ref is None:
            return
        with self.timer("ref"):
            ro.ref_log_probs = self.ref.log_probs(ro)
        if ro.old_log_probs is None:
            return
        metrics["actor/ref_kl"] = masked_mean_global(kl_penalty(ro.old_log_probs, ro.ref_log_probs, "low_var_kl"),
                                                     ro.response_mask)

    def _values(self, ro: RolloutBatch) -> None:
        """`values` from the critic (before its update)."""
        if self.critic is None:
            return
        with self.timer("values"):
            ro.values = self.critic.values(ro)

    def _update_critic(self, ro: RolloutBatch, metrics: dict) -> None:
        self._critic_work = np.zeros(3)
        if self.critic is None:
            return
        cfg = self.cfg
        with self.timer("update_critic"), self.critic.count_work() as work:
            metrics.update(self.critic.update(ro, cfg.critic, cfg.data.train_batch_size // cfg.critic.ppo_mini_batch_size,
                                              seed=cfg.trainer.seed + self.global_step))
        self._critic_work = work
        self.critic.scheduler.step()

    def _update_actor(self, ro: RolloutBatch, metrics: dict) -> None:
        """The actor's update, once the critic has had `trainer.critic_warmup` steps."""
        cfg = self.cfg
        self._update_work = np.zeros(3)
        if self.global_step < cfg.trainer.critic_warmup:
            return
        actor_cfg = cfg.actor_rollout_ref.actor
        with self.timer("update_actor"), self.actor.count_work() as work:
            metrics.update(self.actor.update(ro, actor_cfg, cfg.data.train_batch_size // actor_cfg.ppo_mini_batch_size,
                                             self.kl.in_loss.value, seed=cfg.trainer.seed + self.global_step,
                                             step=self.global_step + 1,
                                             rollout_correction=cfg.algorithm.rollout_correction))
        self._update_work = work
        self.actor.scheduler.step()

    def _gather_other_extras(self, mine: dict[str, list], parts: list[list[int]], n_total: int) -> dict[str, list]:
        """The reward function's non-numeric extras of every rank's rows (`mine`: this rank's,
        `parts[k]`: rank k's rows), in the batch's order on every rank; None where a row has no
        value for a key. Made JSON data on their own rank first (`dump_value`): a value of the
        user's need not pickle. Every rank joins the gather, whatever its rows gave."""
        mine = {k: [dump_value(v) for v in vals] for k, vals in mine.items()}
        every = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        out = {k: [None] * n_total for k in sorted(set().union(*every))}
        for ix, theirs in zip(parts, every):
            for k, vals in theirs.items():
                for i, v in zip(ix, vals):
                    out[k][i] = v
        return out

    def _dump_rollouts(self, full: RolloutBatch, ro: RolloutBatch, parts: list[list[int]], scores: torch.Tensor,
                       extras: dict):
        """`trainer.rollout_data_dir/{step}.jsonl`: every sample of this step in the batch's order,
        written by rank 0. `reward` is the score minus any KL-in-reward penalty; `advantage` the
        mean over the response's tokens in `loss_mask` (rollout rejection's rejected tokens carry
        no advantage), NaN, written null, when rejection left none; then the reward function's
        extras: its numeric ones (null where a sample gave none) and its others as returned
        (`_dump_extras`, `dump_value`; null where a sample did not return the key). Every rank
        joins both gathers to rank 0, the numbers' and the other extras', whatever its rows gave."""
        mask = ro.loss_mask
        adv = torch.where(mask.sum(-1) > 0, masked_mean(ro.advantages.double(), mask, axis=-1), math.nan)
        cols = [scores.double(), ro.token_level_rewards.double().sum(-1), adv]
        names = sorted(extras)
        cols += [torch.tensor(extras[k], dtype=torch.float64, device=self.device) for k in names]
        per_sample = self._gather_rows(torch.stack(cols, dim=1), parts, len(full)).cpu().tolist()
        others = self._gather_other_extras(ro.other_extras or {}, parts, len(full))
        write = None
        if self.ctx.is_main:
            inputs = decode_prompts(self.tokenizer, full)
            outputs = decode_batch(self.tokenizer, full.responses)
            rows = []
            for i, vals in enumerate(per_sample):
                rows.append(_dump_row(full, i, inputs[i], outputs[i], self.global_step + 1, vals[0],
                                      dict(zip(names, vals[3:])), {k: v[i] for k, v in others.items()},
                                      reward=vals[1], advantage=vals[2]))
            write = functools.partial(dump_generations, self.cfg.trainer.rollout_data_dir, self.global_step + 1, rows)
        self._agreed_log(write)

    def _compute_advantages(self, full: RolloutBatch, ro: RolloutBatch, parts: list[list[int]], metrics: dict,
                            baselines: torch.Tensor | None = None) -> None:
        """`token_level_rewards` (scores minus the KL-in-reward penalty, with its controller's
        update, as verl's `apply_kl_penalty` makes them, over `response_mask`), then `advantages` and
        `returns` over the whole batch's `loss_mask` (whitening and group baselines are batch-wide)
        and this rank's rows of them.
        Only the rank-local per-token inputs are gathered (rewards, values, and the old log-probs,
        sums of squared probabilities and rollout importance weights that the optimal-token-baseline
        estimators read, and gdpo's reward components): the response mask and the group ids are known to
        every rank already (`full`), as are `baselines` (`remax`'s greedy scores, `[N]`)."""
        alg = self.cfg.algorithm
        mask = ro.response_mask
        with self.timer("adv"):
            rewards = ro.token_level_scores
            if alg.use_kl_in_reward:
                kld = kl_penalty(ro.old_log_probs, ro.ref_log_probs, alg.kl_penalty) * mask
                beta = self.kl.in_reward.value
                rewards = rewards - beta * kld
                # verl's units: the mean over responses of each response's token mean, and a step of
                # as many samples as the batch has responses (prompts x rollout.n)
                row_kl = masked_mean(kld, mask, axis=-1)
                current_kl = comm.all_reduce_sum(float(row_kl.sum())) / max(len(full), 1)
                self.kl.in_reward.update(current_kl, n_steps=len(full))
                metrics.update({"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta})
            ro.token_level_rewards = rewards
            gather = lambda t: self._gather_rows(t, parts, len(full)) if t is not None else None  # noqa: E731
            otb = alg.adv_estimator in OTB_ESTIMATORS  # the only readers of the last three: gathered for them alone
            # gdpo's own inputs, which no other estimator takes (as verl passes them to gdpo alone)
            gdpo = self._gdpo_inputs(full, gather(ro.reward_components), metrics) if alg.adv_estimator == "gdpo" else {}
            adv, ret = get_adv_estimator_fn(alg.adv_estimator)(
                token_level_rewards=gather(ro.token_level_rewards), response_mask=full.loss_mask,
                values=gather(ro.values), index=np.asarray(full.uids),
                gamma=alg.gamma, lam=alg.lam, norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
                reward_baselines=baselines, old_log_probs=gather(ro.old_log_probs) if otb else None,
                sum_pi_squared=gather(ro.sum_pi_squared) if otb else None,
                rollout_is_weights=gather(ro.rollout_is_weights) if otb else None, **gdpo)
            sel = torch.tensor(parts[self.ctx.rank], dtype=torch.long, device=self.device)
            ro.advantages, ro.returns = adv[sel], ret[sel]

    def _gdpo_inputs(self, full: RolloutBatch, components: torch.Tensor, metrics: dict) -> dict:
        """gdpo's estimator inputs: the whole batch's reward components `[N, K]` (`_place_components`)
        and `algorithm.gdpo_reward_weights`; with verl's `gdpo/{key}/{mean,std,max,min}` metrics of each
        (numpy's: the population std). A row without a finite number under a key (the key missing from
        its result, not a number, NaN) is refused, on every rank alike, naming the key, the row and the
        reward function: verl fails on a missing key or a non-number too, and a NaN would make every
        advantage of the batch NaN (the components' sum is whitened over the batch)."""
        from rewards.registry import describe_fn

        alg = self.cfg.algorithm
        columns = components.double()
        names = ("mean", "std", "max", "min")
        figures = torch.stack([columns.mean(0), columns.std(0, correction=0), columns.amax(0), columns.amin(0)])
        finite = torch.isfinite(columns)
        usable, *values = torch.cat([finite.all().double()[None], figures.flatten()]).tolist()  # one host sync
        if not usable:
            row, k = (~finite).nonzero()[0].tolist()  # the first in the batch's order: the same on every rank
            fn, _ = describe_fn(self.reward_manager.compute_score)
            raise UserError(f"algorithm.gdpo_reward_keys: reward function {fn} returned no number for "
                            f"{alg.gdpo_reward_keys[k]!r} on {full.row_names[row]} (data_source="
                            f"{full.data_sources[row]!r}); gdpo normalises each key's values within the response "
                            "groups, so every response's result needs a finite number under every key")
        count = len(alg.gdpo_reward_keys)
        metrics.update({f"gdpo/{key}/{name}": values[i * count + k]
                        for i, name in enumerate(names) for k, key in enumerate(alg.gdpo_reward_keys)})
        return {"reward_components": components, "reward_weights": alg.gdpo_reward_weights}

    def _pf_ppo_redraw(self, full: RolloutBatch, ro: RolloutBatch, parts: list[list[int]], scores: torch.Tensor,
                       extras: dict, seed: int):
        """PF-PPO (`algorithm.use_pf_ppo`): the step's batch redrawn with replacement after the
        advantages, each response by the weight of its score (its token scores summed, as verl
        sums them; `compute_pf_ppo_indices`), the same draw on every rank (one seeded generator).
        Every rank's per-token tensors, scores and reward extras are gathered, indexed by the draw and
        partitioned again: the updates, the metrics and the dumps see the redrawn batch, as in verl.
        Returns `(full, ro, parts, scores, extras)` of the redrawn batch."""
        n, pf = len(full), self.cfg.algorithm.pf_ppo
        gather = lambda t: self._gather_rows(t, parts, n)  # noqa: E731
        whole = full.take(list(range(n)))
        for name in TOKEN_FIELDS:
            if (t := getattr(ro, name)) is not None:
                setattr(whole, name, gather(t))
        whole.other_extras = self._gather_other_extras(ro.other_extras or {}, parts, n)
        if self.cfg.actor_rollout_ref.actor.router_replay.mode == "R2":  # the pass's record: each rank's rows
            every = [ro.routed_experts]
            if dist.is_initialized() and dist.get_world_size() > 1:
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, ro.routed_experts)
            whole.routed_experts = rows_in_order(every, parts, n)
        names = list(extras)
        cols = gather(torch.stack([scores.double()] + [torch.tensor(extras[k], dtype=torch.float64, device=self.device)
                                                       for k in names], dim=1))
        drawn = compute_pf_ppo_indices(whole.token_level_scores.sum(-1), pf.reweight_method, pf.weight_pow,
                                       torch.Generator().manual_seed(seed)).tolist()
        full = whole.take(drawn)
        ro, parts = self._partition(full, train=True)
        local = cols[whole.index(drawn)][full.index(parts[self.ctx.rank])]
        return (full, ro, parts, local[:, 0].float(), {k: local[:, 1 + j].tolist() for j, k in enumerate(names)})

    def _perf_metrics(self, ro: RolloutBatch, metrics: dict) -> dict:
        dev = self.device
        lengths = ro.lengths()
        response_tokens = ro.responses.lengths().tolist()
        # what the actor's and the critic's updates and the old-log-prob pass ran (a shared prompt once;
        # every rank of a Ulysses group counts its group's micro-batches): the MFUs' FLOPs
        work = self._update_work / self.actor.sp_size
        critic_work = self._critic_work / (self.critic.sp_size if self.critic is not None else 1)
        infer_work = self._infer_work / self.actor.sp_size
        (tokens, generated, run_tokens, run_heads, run_pairs, critic_tokens, _, critic_pairs,
         *infer) = comm.all_reduce_values([float(sum(lengths)), float(sum(response_tokens)), *map(float, work),
                                           *map(float, critic_work), *map(float, infer_work)])
        step_s = metrics.get("timing_s/step", float("nan"))
        per_gpu_s = step_s * self.ctx.world_size if step_s > 0 else float("inf")
        # perf/throughput counts prompt + response tokens per sample (verl's and TRL's figure);
        # the generated tokens alone are what the rollout produced.
        out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_s, "perf/throughput": tokens / per_gpu_s,
               "perf/response_throughput": generated / per_gpu_s}
        # verl's per-token phase times: generation per generated token, the others per token (0 without any)
        for phase in ("gen", "ref", "values", "adv", "update_critic", "update_actor"):
            if (t := metrics.get(f"timing_s/{phase}")) is not None:
                count = generated if phase == "gen" else tokens
                out[f"timing_per_token_ms/{phase}"] = 1000.0 * t / count if count > 0 else 0.0
        # memory peaks under verl 0.9.1's default trainer's names (its actor worker's figures, `actor/perf/*`;
        # one process holds every role here, so no critic/perf/* copy): the largest rank's (the one that runs
        # out first); actor/perf/cpu_memory_used_gb is the host's memory in use (psutil's `used`, the whole
        # machine's), likewise the fullest node's
        host_used = psutil.virtual_memory().used / 2**30
        if dev.type == "cuda":
            allocated, reserved = self.peaks.step_gb()
            update = metrics["perf/max_memory_allocated_update_gb"]
            (out["actor/perf/max_memory_allocated_gb"], out["actor/perf/max_memory_reserved_gb"],
             out["perf/max_memory_allocated_update_gb"], out["actor/perf/cpu_memory_used_gb"]) = comm.all_reduce_values(
                [allocated, reserved, update, host_used], "max")
        else:
            import resource

            out["actor/perf/max_memory_allocated_gb"], out["actor/perf/cpu_memory_used_gb"] = comm.all_reduce_values(
                [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, host_used], "max")
        if self.actor.share_prefix and run_tokens:
            # the share of the update's tokens that sharing prompts did not run
            epochs = self.cfg.actor_rollout_ref.actor.ppo_epochs
            out["perf/prefix_tokens_saved"] = 1.0 - run_tokens / (tokens * epochs)
        peak = _peak_flops(dev)
        upd = metrics.get("timing_s/update_actor")
        if peak and upd and run_tokens:
            flops = self.models.actor_args.flops(run_tokens, run_heads, run_pairs, backward=True,
                                                 lora=getattr(self.models.actor, "lora_config", None))
            out["perf/mfu/actor"] = flops / (upd * peak * self.ctx.world_size)
        upd = metrics.get("timing_s/update_critic")
        if peak and upd and critic_tokens:
            # verl's perf/mfu/critic: its value model's forward and backward over what it trained, every epoch
            flops = critic_update_flops(self.critic.model.args, critic_tokens, critic_pairs,
                                        lora=getattr(self.critic.model, "lora_config", None))
            out["perf/mfu/critic"] = flops / (upd * peak * self.ctx.world_size)
        infer_s = metrics.get("timing_s/old_log_prob")
        if peak and infer_s and infer[0]:
            # verl's perf/mfu/actor_infer: the old-log-prob pass, forward only (verl divides its forward and
            # backward estimate by 3), over its time
            out["perf/mfu/actor_infer"] = (self.models.actor_args.flops(*infer, backward=False)
                                           / (infer_s * peak * self.ctx.world_size))
        return out

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        """Generate `val_kwargs.n` responses for every validation prompt (`data.val_batch_size` at
        a time), score each once over the ranks and return, on every rank, `val/{data_source}/score`
        (the mean score of the source's samples) and verl's `val-core/` / `val-aux/` metrics
        (`trainer.val_metrics`) of the variables `reward` (the score) and each numeric extra of the
        reward function (an extra named `reward` is not one: the score holds that name), with its
        `pred` extra, if any, voting; then validation's timings."""
        if self.val_ds is None:
            return {}
        items = [self.val_ds[i] for i in range(len(self.val_ds))]
        bs = self.cfg.data.val_batch_size or len(items)
        dump_dir = self.cfg.trainer.validation_data_dir
        dumped: list[dict] = []
        shown: list[tuple] = []  # (prompt ids, response, score) for trainer.log_val_generations
        sources, uids, scores_all, turns = [], [], [], []
        variables: dict[str, list[float]] = {}  # numeric extras over every chunk, NaN where a chunk had none
        preds: list | None = None  # the `pred` extra as returned (None where a sample gave none)
        with self.timer("testing"):  # verl's timing_s/testing
            for s in range(0, len(items), bs):
                chunk = items[s:s + bs]
                # each chunk its own noise (chunk s's prompt i is not chunk 0's), none a training step's
                ro = self._generate_all(chunk, validate=True, seed=derive_seed(self.cfg.trainer.seed, s))
                texts = decode_batch(self.tokenizer, ro.responses)
                ro.row_names = reward_row_names(ro, chunk, f"validation batch {s // bs + 1}")
                # every rank holds every row here: each is scored once over the ranks
                scores, extras, others = self._score_spread(ro, texts, with_extras=True)
                scores = scores.tolist()
                done, n = len(scores_all), len(scores)
                sources += [str(src) for src in ro.data_sources]
                uids += [s + u for u in ro.uids]  # the prompt's index in the validation set
                scores_all += scores
                turns += turn_counts(ro)
                for k in extras:
                    variables.setdefault(k, [math.nan] * done)
                for k, v in variables.items():
                    v += extras.get(k, [math.nan] * n)
                chunk_preds = others.get("pred", extras.get("pred"))
                if chunk_preds is not None and preds is None:
                    preds = [None] * done
                if preds is not None:
                    preds += chunk_preds if chunk_preds is not None else [None] * n
                if dump_dir and self.ctx.is_main:
                    dumped += validation_dump_rows(ro, decode_prompts(self.tokenizer, ro), texts,
                                                   self.global_step, scores, extras, others)
                if self.cfg.trainer.log_val_generations and self.ctx.is_main:
                    shown += zip(ro.prompts, texts, scores)
            picked = val_samples_to_log(self.tokenizer, shown, self.cfg.trainer.log_val_generations)
            for _, prompt, text, score in picked:
                self.log(f"[val] {prompt!r} -> {text!r} (score {score})")
            if picked:  # to TensorBoard and wandb with the validation's row, as verl's table (its texts)
                self.tracking.queue_generations([(prompt, text, score) for prompt, _, text, score in picked])
            sums: dict[str, list[float]] = {}
            for src, sc in zip(sources, scores_all):
                sums.setdefault(src, []).append(sc)
            out = {f"val/{src}/score": sum(v) / len(v) for src, v in sums.items()}
            variables.pop("reward", None)
            out.update(validation_metrics(sources, uids, {"reward": scores_all, **variables}, preds))
            if turns:  # the turns' counts over every sample (2 a single-turn one's), as verl 0.9.1 logs them
                out.update({"val-aux/num_turns/min": min(turns), "val-aux/num_turns/max": max(turns),
                            "val-aux/num_turns/mean": sum(turns) / len(turns)})
        if dump_dir:  # (the same on every rank; the rows are rank 0's)
            self._agreed_log(functools.partial(dump_generations, dump_dir, self.global_step, dumped) if dumped else None)
        # validation's own phases (its generation's reshard, graph capture) as val_*: the step's
        # timings of the same names stay the step's
        out.update({k if k == "timing_s/testing" else k.replace("timing_s/", "timing_s/val_", 1): v
                    for k, v in self.timer.pop().items()})
        return out

    def _validate_apart(self) -> dict:
        """`validate()` with every RNG put back after it: the training draws the same with validations
        or without, and a checkpoint written before a validation resumes the run as it went on."""
        with rng_set_aside():
            return self.validate()

    # ------------------------------------------------------------------ loop
    def _save_checkpoint(self, row: dict | None) -> None:
        """The step's checkpoint, a phase of its own (a collective that fails in it is reported in
        it), with `row` (the step's metrics; None: its row is already logged) logged once the
        checkpoint is written and before it is put in place, with the writing's time (verl's
        `timing_s/save_checkpoint`). A process killed before the checkpoint is in place resumes
        from an earlier one, dropping the rows after it (`Tracking.begin`) and logging this step
        again; killed after, it resumes with this step's row logged: each step's row once either way."""
        self.guard.note_checkpoint(self.global_step)  # (before the writing: the guard's state there knows it)
        with self.timer("save_checkpoint"):
            self.ckpt.write(self.global_step)
        timing = self.timer.pop()
        try:
            if row is not None:
                self._log_row({**row, **timing})
        except UserError:  # the logs' disk refused the row (full, a quota): the training is kept all the same
            self._publish_checkpoint()
            raise
        self._publish_checkpoint()

    def _publish_checkpoint(self) -> None:
        """The step's written checkpoint put in place (`CheckpointManager.publish`), in the checkpoint's
        phase; its time (a rename and the rotation) is in no row: the step's is already logged."""
        with self.timer("save_checkpoint"):
            self.ckpt.publish(self.global_step)
        self.timer.pop()

    def _delete_earlier_exports(self) -> None:
        """`resume_mode=disable` starts the run directory over: the earlier run's final exports
        (`hf_actor/`, `lora_adapter/`) go with its checkpoints, so that none is taken for this run's;
        except one that this run reads (a model, adapter or tokenizer of a second stage trained
        from the first's export), which is kept, with a line that says so."""
        def delete():
            for d in (Path(self.run_dir, name).resolve() for name in (HF_EXPORT, ADAPTER_EXPORT)):
                if not d.is_dir():
                    continue
                if paths_read_under(self.cfg, d):
                    self.log(f"trainer.resume_mode=disable: keeping the earlier run's export {d}: this run reads it")
                else:
                    self.log(f"trainer.resume_mode=disable: deleting the earlier run's export {d}")
                    shutil.rmtree(d)
        agreed_write(f"deleting the earlier run's exports in {self.run_dir}", delete if self.ctx.is_main else None)

    def _apply_guard(self, metrics: dict) -> None:
        # actor/ref_kl (low_var_kl, clamped per token: `KLGuardConfig` refuses thresholds it cannot
        # reach) is measured whenever there is a reference; KL-in-reward's actor/reward_kl_penalty
        # (algorithm.kl_penalty, possibly unbounded) needs one too, so it is never the fallback.
        kl = metrics.get("actor/ref_kl")
        if kl is None or not self.cfg.algorithm.kl_guard.enable:
            return
        decision = self.guard.check(kl, step=self.global_step)
        metrics["kl_guard/status"] = {"healthy": 0.0, "warning": 1.0, "exploding": 2.0}[decision.status]
        if decision.action is None:
            return
        self.log(f"[kl_guard] step {self.global_step}: {decision.message} -> {decision.action}")
        metrics["kl_guard/action"] = decision.action
        if decision.action == "raise_coef":
            self.kl.raise_coefs(self.guard.next_kl_coef, in_reward=self.cfg.algorithm.use_kl_in_reward,
                                in_loss=self.cfg.actor_rollout_ref.actor.use_kl_loss)
        elif decision.action == "lower_lr":
            for role in (self.actor, self.critic):
                if role is not None:
                    role.scale_lr(self.guard.next_lr)
        elif decision.action == "rollback":
            if not self._rollback(decision.streak_start):
                metrics["kl_guard/action"] = "rollback_skipped"  # (the row says what was done: nothing)
        elif decision.action == "stop":
            raise StopTraining(f"KL guard stopped the run at step {self.global_step}: {decision.message}")

    def _rollback(self, streak_start: int) -> bool:
        """The guard's `rollback` at this step, for a streak that began at `streak_start`: the models
        and optimizers of the newest checkpoint from before the weights the streak judged
        (`KLGuard.rollback_target`); the KL coefficients, LR schedules and everything else carry on.
        Whether it rolled back: False, with a log line, where no checkpoint qualifies."""
        step, guard = self.global_step, self.guard
        steps = self.ckpt.complete_steps()
        target = guard.rollback_target(steps, step, streak_start)
        if target is None:
            abandoned = [s for s in steps if guard.abandoned(s)]
            self.log(f"[kl_guard] step {step}: no checkpoint to roll back to: the KL streak began at step "
                     f"{streak_start}, so the rollback needs a checkpoint of step <= "
                     f"{guard.rollback_bound(step, streak_start)} (checkpoints: {steps or 'none'}"
                     f"{f', of abandoned branches: {abandoned}' if abandoned else ''}); continuing")
            return False
        path = self.ckpt.rollback(target)
        guard.record_rollback(target, step)
        self.log(f"[kl_guard] step {step}: rolled back the models to {path} (step {target}; the KL streak began at "
                 f"step {streak_start}); continuing at step {step + 1} with new data, the KL coefficients and "
                 "learning rates as they are")
        return True

    def train(self) -> int:
        t = self.cfg.trainer
        resumed = self.ckpt.maybe_resume(t.resume_mode, t.resume_from_path)
        if t.resume_mode == "disable":
            self._delete_earlier_exports()
        if resumed is not None:
            self.log(f"resumed from {resumed} at step {self.global_step}")
            # checkpoints above it are another run's: never a rollback's target (until this run writes its own)
            self.guard.note_resume(self.global_step, self.ckpt.complete_steps())
            if self.global_step >= self.total_steps and not t.val_only:
                self.log(f"the run's {self.total_steps} steps (trainer.total_training_steps, or the data's batches x "
                         f"trainer.total_epochs) are done at step {self.global_step}: nothing to train; raise "
                         "trainer.total_training_steps to train on")
        faults.at_step_start(0, self.ctx.rank)  # (step 0: before the run's first collective, the logs' start)
        self._begin_logs()
        self._install_signal_handlers()
        try:
            # verl validates before the first step; val_only (data.val_files required) validates the
            # model as it starts, a checkpoint's when it resumes, and ends the run there.
            if t.val_only or (t.val_before_train and self.global_step == 0 and self.val_ds is not None):
                self._log_row(self._validate_apart())
            if t.val_only:
                self.log(f"trainer.val_only: validated the model of step {self.global_step}, exiting without training")
                return 0
            while self.global_step < self.total_steps:
                loader_state, kl_state, rng = self.loader.state_dict(), self.kl.state_dict(), RngSnapshot()
                try:
                    with self.profiler.step(self.global_step + 1):
                        metrics = self.step()
                except _AbandonStep:
                    # No model was updated: rewind the data, the KL-in-reward controller (it steps
                    # with the advantages, before the abandon check) and every RNG (the rollout's and
                    # the reward function's draws) so the resumed run redoes this step as an
                    # uninterrupted run would, and write the checkpoint unless the last step's is
                    # already there.
                    self.loader.load_state_dict(loader_state)
                    self.kl.load_state_dict(kl_state)
                    rng.restore()
                    self.timer.pop()
                    if self.ckpt.saved_step != self.global_step:
                        self._save_checkpoint(None)  # (the step's row is logged already)
                    self.log(f"preempted: step {self.global_step + 1} abandoned (no time to finish it within "
                             f"trainer.preemption_grace_s), checkpoint of step {self.global_step} written, exiting")
                    return 0
                metrics.update({"training/global_step": self.global_step, "training/epoch": self.loader.batch_epoch,
                                **trajectory_version_metrics()})
                try:
                    self._apply_guard(metrics)
                    skipped = metrics.get("actor/nonfinite_skipped", 0.0) + metrics.get("critic/nonfinite_skipped",
                                                                                         0.0)
                    self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
                    if self.nonfinite_streak >= t.max_nonfinite_steps:
                        raise StopTraining(f"{self.nonfinite_streak} consecutive steps had a non-finite loss or "
                                           "gradient norm (optimizer steps skipped); lower the learning rate or "
                                           "check the data")
                except StopTraining:
                    self._log_row(metrics)  # the step that stopped the run, logged
                    raise
                last = self.global_step >= self.total_steps
                # The checkpoint and the step's metrics come before the validation, so that a validation that
                # fails (its own data, reward, memory) or a process killed during it loses no training; the
                # validation's metrics are a row of their own at the same step. A signal skips the validation
                # (the resumed run does not repeat the step), the last step's excepted; a signal during the
                # validation is acted on after it.
                stop = self._agreed_stop_signal()
                due = self.val_ds is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last)
                if stop or last or (t.save_freq > 0 and self.global_step % t.save_freq == 0):
                    self._save_checkpoint(metrics)  # (the row logged before the checkpoint is in place)
                else:
                    self._log_row(metrics)
                if due and (last or not stop):
                    validation = self._validate_apart()
                    validation.update({k: metrics[k] for k in ("training/global_step", "training/epoch")})
                    signalled = not stop and self._agreed_stop_signal()  # a signal during the validation
                    stop = stop or signalled
                    if signalled and self.ckpt.saved_step != self.global_step:
                        self._save_checkpoint(validation)  # (its row logged before the checkpoint is in place)
                    else:
                        self._log_row(validation)
                elif due:
                    self.log(f"stopping for a signal: step {self.global_step}'s validation skipped, the "
                             "checkpoint written first")
                if stop:
                    self.log(f"received signal {self._stop_signal or 'on another rank'}: checkpoint written at step "
                             f"{self.global_step}, exiting")
                    return 0
            if t.export_hf_at_end:
                export_hf(self.models.actor, self.models.actor_args, self.tokenizer,
                          os.path.join(self.run_dir, HF_EXPORT), self.ctx.is_main,
                          adapter_dir=os.path.join(self.run_dir, ADAPTER_EXPORT),
                          base_model=self.cfg.actor_rollout_ref.model.path)
            return 0
        finally:
            self.profiler.close()
            self.reward_manager.close()
            self.tracking.close()


def _collective_failure(e: RuntimeError) -> bool:
    """A timed-out or broken collective: NCCL raises DistError, gloo a RuntimeError from its transport."""
    return isinstance(e, dist.DistError) or "gloo/transport" in str(e) or "Timed out waiting" in str(e)


def run(cfg: PPOConfig) -> int:
    """Entry point used by train_ppo.py. A config error: exit code 2, an input error: exit code 1,
    each with a message from every rank that hit it; a collective that timed out or lost its peer:
    `launch.RESTART_EXIT` (torchrun restarts the ranks), unless a rank stopped on an error first."""
    from agent import InteractionError, ToolError
    from data import DatasetError
    from rewards import RewardError

    # An NCCL watchdog timeout aborts the process from a C++ thread: the Python stacks it prints
    # then show the phase each rank was in. The process's own stderr: sys.stderr may be a
    # stream without a file descriptor (an in-process run whose output is captured).
    faulthandler.enable(file=sys.__stderr__)
    ctx = init_distributed(cfg.trainer.device, timeout_s=cfg.trainer.nccl_timeout)
    finished, trainer = False, None
    try:
        trainer = PPOTrainer(cfg, ctx)
        code = trainer.train()
        finished = code == 0
        return code
    except ConfigError as e:
        # Found while the run starts (its data, checkpoint, tools): possibly by one rank alone, whose
        # peers are then in a collective that fails when it exits. Every rank says its own.
        say(f"meshppo: config error: {e}" if ctx.world_size == 1 else f"meshppo: config error (rank {ctx.rank}): {e}")
        return stopping_on_error(2)
    except (UserError, DatasetError, RewardError, ToolError, InteractionError, OSError, CheckpointFileError) as e:
        # Every rank says what it hit: an error of one rank alone (a file of its own) would
        # otherwise show only as the other ranks' failed collective.
        say(f"meshppo: error (rank {ctx.rank}): {e}")
        return stopping_on_error(1)
    except StopTraining as e:
        if ctx.is_main:
            print(f"meshppo: stopped: {e}", file=sys.stderr)
        return stopping_on_error(3)
    except RuntimeError as e:
        if not _collective_failure(e):
            raise
        # A collective timed out or lost a peer: say where, on every rank. A restart can fix a hung or
        # crashed peer (`collective_failure_exit`), not one that stopped on an error of its own.
        first = str(e).strip().splitlines()[0]
        phase = getattr(e, "meshppo_phase", None)
        where = (f"in phase '{phase}'" if phase else "during setup" if trainer is None
                 else f"outside the timed phases, at step {trainer.global_step}")
        say(f"meshppo: error (rank {ctx.rank}): a collective failed {where} "
            f"({as_set(cfg, 'trainer.nccl_timeout', cfg.trainer.nccl_timeout)} s): {first[:300]}")
        return collective_failure_exit()
    finally:
        if ctx.owns_group and dist.is_initialized():
            if finished:
                # No rank tears its gloo threads down while a peer may still be inside the last
                # collective: that aborted a rank at exit ("terminate called without an active
                # exception", exit -6) after a run that had finished. After an error, a peer may
                # never arrive: no barrier then.
                dist.barrier()
            dist.destroy_process_group()


__all__ = ["PPOTrainer", "run"]
