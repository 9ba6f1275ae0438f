"""The roles of a PPO step: actor, reference, critic and reward model.

Each role owns its FSDP2-sharded model, its optimizer and scheduler (the trainable ones) and
its memory placement (`fsdp_config.param_offload` / `optimizer_offload`: where its states wait
between the phases that use them). Forward-only passes (old log-probs, reference log-probs,
values, reward scores) all run through one micro-batch loop, `forward_micro_batches`; the actor
and critic updates share one skeleton, `TrainableRole._update`, which takes the role's loss: PPO
epochs × mini-batches × micro-batches with the loss normalised to the global token (or
sequence) mean of the mini-batch, so the gradient does not depend on how sequences were packed
into micro-batches or spread over ranks (`ppo.core_algos.agg_loss`).

A role with Ulysses sequence parallelism (`sp`, `sharding.ulysses`) first pools the rows of its
group's ranks (`pool_rows`): the group runs every micro-batch of the pooled rows together, each
rank on its shard of the tokens, and each rank keeps its own rows of a forward pass's outputs.
"""

from __future__ import annotations


import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple, Protocol

import numpy as np
import torch
import torch.distributed as dist

from kl import kl_penalty
from models.lora import adapters_disabled, lora_modules
from trainer import faults
from trainer.batching import PrefixGroups, seqlen_workload, shared_prefix_items, token_budget_partitions
from ppo.core_algos import (BYPASS_LOSS_TYPES, PolicyLossParams, agg_loss, compute_rollout_correction,
                            compute_value_loss, count_loss_units, get_policy_loss_fn, masked_mean, masked_sum)
from trainer.forward import RoutingRecord, build_micro_batch, last_token_scores, response_logprobs, response_values
from trainer.rollout_batch import OPTIONAL_SEQUENCE_FIELDS, SEQUENCE_FIELDS, TOKEN_FIELDS, RolloutBatch, join_rows
from sharding import comm
from sharding.ulysses import SequenceParallel, gather_rows
from sharding.fsdp import (FSDPConfig, keep_compute_copies, load_states, no_gradient_sync, offload_states,
                           release_gradients)
from sharding.grad_norm import clip_grad_norm_
from sharding.replicate import replicated_params


def plan_micro_batches(indices: list[int], lengths: list[int], micro_size: int | None, dynamic: bool,
                       max_tokens: int, groups: PrefixGroups | None = None) -> list[list[int]]:
    """Split `indices` (of this rank) into micro-batches; every rank gets the same count.

    Fixed size: `micro_size` sequences each (None: all in one); a rank holding fewer sequences than
    another gets empty micro-batches up to the largest count. Dynamic: verl 0.9.1's micro-batches
    under the `max_tokens` budget (`token_budget_partitions`: its count agreed over the ranks, its
    Karmarkar-Karp balance of the rows' work estimates, its order), each listing its rows in
    `indices`' order; with `groups` (prefix sharing) the rows of one prompt pack together, the prompt
    counted once in the tokens (`shared_prefix_items`), a group's work the sum of its rows' (as
    verl's groups of rows).
    """
    return _plan([indices], lengths, micro_size, dynamic, max_tokens, groups)[0]


def _plan(batches: list[list[int]], lengths: list[int], micro_size: int | None, dynamic: bool,
          max_tokens: int, groups: PrefixGroups | None = None) -> list[list[list[int]]]:
    """`plan_micro_batches` for several batches with one collective (dynamic: one a round of the
    budget check)."""
    if not dynamic:
        out = []
        for indices in batches:
            size = micro_size or len(indices)
            out.append([indices[s:s + size] for s in range(0, len(indices), size)] or [[]])
        if micro_size is not None and comm.world_size() > 1:
            counts = comm.all_reduce_values([len(p) for p in out], "max")
            out = [p + [[] for _ in range(int(n) - len(p))] for p, n in zip(out, counts)]
        return out
    if groups is None:
        items = [[[i] for i in indices] for indices in batches]
        tokens = [[lengths[i] for i in indices] for indices in batches]
    else:
        items, tokens = map(list, zip(*(shared_prefix_items(indices, *groups, max_tokens) for indices in batches)))
    work = [[sum(seqlen_workload([lengths[i] for i in item])) for item in its] for its in items]
    reduce = comm.all_reduce_values if comm.world_size() > 1 else None
    parts = token_budget_partitions(tokens, work, max_tokens, reduce)
    return [[[i for j in p for i in its[j]] for p in ps] for its, ps in zip(items, parts)]


class MicroBatching(NamedTuple):
    """How a forward-only pass cuts this rank's rows: `size` sequences a micro-batch (None: all),
    or with `dynamic` packed under `max_tokens` tokens each."""

    size: int | None
    dynamic: bool
    max_tokens: int


def pool_rows(ro: RolloutBatch, sp: SequenceParallel | None) -> tuple[RolloutBatch, slice]:
    """The rows of every rank of `sp`'s group, in rank order (the per-sequence lists and every
    per-token tensor that is set), and where this rank's rows sit among them; `ro` itself without
    sequence parallelism. Every rank of the group gets the same rows."""
    if sp is None:
        return ro, slice(0, len(ro))
    every: list = [None] * sp.size
    # the optional lists a batch has, every rank's alike (a multi-turn batch's turn masks among them)
    names = SEQUENCE_FIELDS + tuple(name for name in OPTIONAL_SEQUENCE_FIELDS if getattr(ro, name) is not None)
    dist.all_gather_object(every, {name: getattr(ro, name) for name in names}, group=sp.group)
    counts = [len(e["prompts"]) for e in every]
    tensors = {name: gather_rows(t, sp, counts) for name in TOKEN_FIELDS if (t := getattr(ro, name)) is not None}
    lists = {name: join_rows([e[name] for e in every]) for name in names}
    start = sum(counts[:sp.rank])
    return RolloutBatch(**lists, width=ro.width, device=ro.device, **tensors), slice(start, start + len(ro))


def sp_batching(batching: MicroBatching, sp: SequenceParallel | None) -> MicroBatching:
    """A pooled group's micro-batching: its token budget is per GPU, and a group's micro-batch
    spreads over its `sp.size` GPUs (verl multiplies it so too); `size` sequences stay a
    micro-batch of the group."""
    return batching if sp is None else batching._replace(max_tokens=batching.max_tokens * sp.size)


@torch.no_grad()
def forward_micro_batches(ro: RolloutBatch, batching: MicroBatching, forward: Callable[[RolloutBatch], tuple],
                          model: torch.nn.Module, sp: SequenceParallel | None = None,
                          share_prefix: bool = False) -> list[torch.Tensor | None]:
    """The one micro-batch loop of the forward-only passes: plan the micro-batches (every rank
    the same count), run `forward(rows) -> (tensor [B, ...] or None, ...)` (a forward of `model`)
    on each, scatter each output into `[N, ...]` (float32 zeros where no row wrote); an output that
    is a `RoutingRecord` (routing replay R2) is joined into the `N` rows' `Ragged` once the loop is
    done (its copies to the host waited for then, not inside the loop). A
    micro-batch without rows still runs its forward, so that FSDP's collectives stay in step
    over ranks. The micro-batches share one cast of the masters (`keep_compute_copies`). With
    `sp` the group's rows are pooled first and this rank's rows of the outputs returned.
    `share_prefix`: dynamic micro-batches keep the rows of one prompt together
    (`plan_micro_batches`)."""
    ro, mine = pool_rows(ro, sp)
    batching = sp_batching(batching, sp)
    groups = ro.prefix_groups() if share_prefix else None
    with keep_compute_copies(model):
        outs = None
        for part in plan_micro_batches(list(range(len(ro))), ro.lengths(), *batching, groups=groups):
            results = forward(ro.take(part))
            if outs is None:
                outs = [None if r is None else [] if isinstance(r, RoutingRecord)
                        else torch.zeros((len(ro),) + tuple(r.shape[1:]), device=ro.device) for r in results]
            rows = ro.index(part) if part else None
            for out, r in zip(outs, results):
                if isinstance(r, RoutingRecord):  # (an empty micro-batch's too: no rows, but its record's shape)
                    out.append((part, r))
                elif r is not None and part:
                    out[rows] = r
        return [None if o is None else RoutingRecord.join(o, len(ro))[mine] if isinstance(o, list) else o[mine]
                for o in outs]


@dataclass
class MiniBatch:
    """One optimizer step of an update: this rank's micro-batches and the loss units of the whole
    mini-batch summed over every rank, for the global-mean loss: its tokens (those rollout
    rejection kept) and its non-empty responses (counted before rejection, as verl's
    global_batch_size) (both: a policy loss may aggregate its own way, e.g. SAPO by sequence,
    while the entropy and KL terms follow `loss_agg_mode`)."""

    parts: list[list[int]]
    global_tokens: float
    global_seqs: float


def plan_update(ro: RolloutBatch, epochs: int, num_mini_batches: int, shuffle: bool, seed: int,
                micro_size: int | None, dynamic: bool, max_tokens: int, sp_size: int = 1,
                share_prefix: bool = False) -> list[MiniBatch]:
    """Every mini-batch of every epoch, planned before the first forward with a few collectives
    (the loss units, the micro-batch counts and, dynamic, a round of budget checks while a count
    grows), so that the update loop itself never waits for the host: a collective read back inside
    it would drain the GPU queue each mini-batch.
    `ro` holds the rows of `sp_size` ranks (`pool_rows`), each counted once in the loss units."""
    n = len(ro)
    mini = n // num_mini_batches
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n))
        batches += [order[m * mini:(m + 1) * mini] for m in range(num_mini_batches)]
    # The host's own masks (no read-back of the device's), every mini-batch's rows in one gather
    # (mini-batches are equal-sized), in NumPy: a torch CPU op here waited up to 3 ms for torch's
    # thread pool on a busy host, with the GPU idle (profiled at the start of an update phase).
    # The tokens are those rollout rejection kept (`loss_mask`); the sequences are counted before
    # it, as verl's global_batch_size: a row that rejection emptied adds nothing but still counts.
    rows = np.asarray(batches, dtype=np.int64)
    counts = []
    for kept, responses in zip(ro.host_loss_mask()[rows], ro.host_response_mask()[rows]):
        counts += [count_loss_units(kept, "token-mean"), count_loss_units(responses, "seq-mean-token-mean")]
    units = [u / sp_size for u in comm.all_reduce_values(counts)]
    plans = _plan(batches, ro.lengths(), micro_size, dynamic, max_tokens, ro.prefix_groups() if share_prefix else None)
    return [MiniBatch(parts, *units[2 * i:2 * i + 2]) for i, parts in enumerate(plans)]


def _grad_norm_and_step(model, optimizer, grad_clip: float, step: int = -1):
    """Clip the global grad norm and step only if it is finite; returns (norm, skipped) as 0-dim
    tensors. Every rank sees the same norm (it is reduced over all shards), so a skip is
    consistent without extra communication. Fused optimizers take the skip as a device flag
    (`found_inf`, as under a GradScaler: no update, no step count), so nothing waits for the
    host; others read the norm back."""
    faults.poison_grads(model, step, comm.rank())
    rp = replicated_params(model)
    norm = clip_grad_norm_(model.parameters(), max_norm=grad_clip, flat=rp.flat_gradients() if rp is not None else None)
    if optimizer.defaults.get("fused"):
        skipped = (~torch.isfinite(norm)).float()
        optimizer.found_inf = skipped
        optimizer.step()
    else:
        skipped = torch.tensor(0.0 if math.isfinite(float(norm)) else 1.0)
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_gradients(model)
    return norm, skipped


class _Mean:
    """Averages metrics over micro-/mini-batches and ranks. Values may be device tensors: they are
    only read back in `result()` (one host sync), never inside the update loop.

    Each value is added to a group (`add(group, ...)`): a key's result combines, over its groups,
    each group's mean over every value that every rank added to it, as verl 0.9.1's
    `reduce_metrics` combines a role's mini-batches: the largest of them for a key whose name holds
    "max", the smallest for one holding "min", else their mean. One group per mini-batch gives
    verl's `Metric` of aggregation MEAN (a mini-batch's micro-batches of every rank, then the
    mini-batches), one group for the whole update verl's plain floats (every micro-batch of every
    mini-batch and rank); the two differ where mini-batches run different numbers of micro-batches
    (use_dynamic_bsz)."""

    def __init__(self, groups: int):
        self.groups = groups
        self.values: dict[str, dict[int, list]] = {}

    def add(self, group: int, **kv):
        for k, v in kv.items():
            value = v.detach().double().reshape(()) if torch.is_tensor(v) else float(v)
            self.values.setdefault(k, {}).setdefault(group, []).append(value)

    def result(self) -> dict[str, float]:
        """The means (one collective for all of them: every rank adds the same keys, as every rank
        runs the same micro-batches; a group may lack values on some ranks, as an empty micro-batch
        adds none, and a group without values on any rank is left out of its key's mean)."""
        cells = [self.values[k].get(g, []) for k in self.values for g in range(self.groups)]
        if not cells:
            return {}
        zero = torch.zeros((), dtype=torch.float64)
        sums = [zero if not vs else torch.stack(vs).sum() if torch.is_tensor(vs[0]) else zero + sum(vs)
                for vs in cells]
        dev = next((m.device for m in sums if m.device.type != "cpu"), torch.device("cpu"))
        local = torch.stack([m.to(dev) for m in sums]).tolist() + [float(len(vs)) for vs in cells]
        reduced = comm.all_reduce_values(local)
        out = {}
        for i, k in enumerate(self.values):
            cell = range(i * self.groups, (i + 1) * self.groups)
            means = [reduced[c] / reduced[len(cells) + c] for c in cell if reduced[len(cells) + c]]
            out[k] = max(means) if "max" in k else min(means) if "min" in k else sum(means) / len(means)
        return out


class LossTerms(NamedTuple):
    """What a role's loss gives the update skeleton for one micro-batch: the loss to backpropagate,
    detached terms summed over the mini-batch's micro-batches (each a share of the global mean, so
    the sum is the mini-batch's global-mean loss) and then averaged over the mini-batches and
    epochs, as verl's engine workers report `actor/pg_loss`, `actor/kl_loss` and `critic/vf_loss`,
    and detached statistics averaged over micro-batches."""

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    means: dict[str, torch.Tensor]


class Role:
    """One model on this rank and its memory placement: with `fsdp_config.param_offload` /
    `optimizer_offload` its states wait in host memory between the phases that use them
    (`offload` / `load`, or `resident()` for one phase). `fsdp_cfg=None`: always on the device."""

    def __init__(self, model, *, device: torch.device, packed: bool, pad_token_id: int,
                 batching: MicroBatching | None = None, fsdp_cfg: FSDPConfig | None = None, optimizer=None,
                 scheduler=None, sp: SequenceParallel | None = None, share_prefix: bool = False):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.packed, self.pad = device, packed, pad_token_id
        self.batching, self.fsdp_cfg, self.sp = batching, fsdp_cfg, sp
        # prefix sharing (actor.use_prefix_grouper): rows of one prompt lay it out once a micro-batch
        self.share_prefix = share_prefix
        self.work = np.zeros(3)  # tokens run, positions scored, attention pairs (`count_work`)

    @property
    def sp_size(self) -> int:
        """The role's Ulysses group size (1: none)."""
        return 1 if self.sp is None else self.sp.size

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel group (its Ulysses group; without one, its rank)."""
        return comm.rank() // self.sp_size

    def offload(self, params: bool = True) -> None:
        """Send the states the FSDP config offloads to host memory (no-op for flags that are off);
        `params=False`: only the optimizer states (the parameters are in use: `rollout.name=hf`)."""
        if self.fsdp_cfg is not None:
            offload_states(self.model, self.optimizer, self._offloaded(params))

    def load(self, params: bool = True) -> None:
        """Bring back what `offload(params)` moved."""
        if self.fsdp_cfg is not None:
            load_states(self.model, self.optimizer, self._offloaded(params), self.device)

    def _offloaded(self, params: bool) -> FSDPConfig:
        return self.fsdp_cfg if params else replace(self.fsdp_cfg, param_offload=False)

    @contextmanager
    def resident(self, with_optimizer: bool):
        """The parameters (and, `with_optimizer`, the optimizer states) on the device for one
        phase, back in host memory after it."""
        if self.fsdp_cfg is None:
            yield
            return
        optimizer = self.optimizer if with_optimizer else None
        load_states(self.model, optimizer, self.fsdp_cfg, self.device)
        try:
            yield
        finally:
            offload_states(self.model, optimizer, self.fsdp_cfg)

    def _micro_batch(self, sub: RolloutBatch, replay: bool = False, record: bool = False):
        """`sub` laid out for a forward; `replay`: with its routed experts (routing replay), which it must have;
        `record`: the forward records its routing (`trainer.forward.RoutingRecord`)."""
        if replay and sub.routed_experts is None:
            raise ValueError("routing replay without the rows' routed experts: actor.router_replay.mode=R3 replays "
                             "the rollout's (actor_rollout_ref.rollout.enable_rollout_routing_replay must be on), R2 "
                             "the old-log-prob pass's record (Actor.log_probs)")
        mb = build_micro_batch(sub.prompts, sub.responses, self.device, self.packed, self.pad, self.sp,
                               self.share_prefix, sub.routed_experts if replay else None, record)
        if sub.prompts:  # an empty micro-batch's placeholder row is not work
            self.work += mb.work
        return mb

    @contextmanager
    def count_work(self):
        """Yields the work this role's forwards run inside the block (tokens, scored positions,
        attention pairs of the whole micro-batches, not of this rank's shard), for MFU: what runs,
        a shared prompt once. Once the block ends the role counts into a fresh array: the yielded
        one keeps the block's work (a LoRA run's reference pass, the actor's own forwards with its
        adapters off, is not its old-log-prob pass's)."""
        self.work = np.zeros(3)
        try:
            yield self.work
        finally:
            self.work = np.zeros(3)


class TrainableRole(Role):
    """A role with an optimizer and a learning-rate schedule: the actor and the critic."""

    def __init__(self, model, optimizer, scheduler, *, world_size: int, response_length: int, **kw):
        super().__init__(model, optimizer=optimizer, scheduler=scheduler, **kw)
        self.world_size, self.response_length = world_size, response_length

    def scale_lr(self, next_lr) -> None:
        """Apply `next_lr` to the learning rate now and to the schedule's base (a KL guard's
        `lower_lr`)."""
        self.scheduler.base_lrs = [next_lr(lr) for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] = next_lr(group["lr"])

    def _update(self, ro: RolloutBatch, cfg, num_mini_batches: int, seed: int, prefix: str,
                forward: Callable[[RolloutBatch, int], tuple],
                loss: Callable[[RolloutBatch, tuple, int, dict], LossTerms], sum_keys: tuple[str, ...],
                step: int = -1, loss_scale_factor: float | None = None,
                join: Callable[[], None] | None = None, per_mini_batch: bool = False) -> dict:
        """The update skeleton: PPO epochs × mini-batches × micro-batches of `loss`.

        `forward(rows, k)` runs the model on micro-batch rows of mini-batch `k` (first output a
        tensor); `loss(rows, outputs, k, agg_kwargs)` gives the `LossTerms` (`agg_kwargs`: the global
        counts, and `loss_scale_factor`, else the response length, for seq-mean-token-sum-norm).
        Where `loss` runs a collective, `join()` runs the same one on a rank whose micro-batch is empty.
        The whole update is planned first (`plan_update`); inside the loop nothing waits for the host: the micro-batch
        indices go over without a sync (`RolloutBatch.index`, `models.transfer.host_to_device`), a
        non-finite gradient skips the step on a device flag (fused AdamW), and the metrics are
        read back once, at the end. Returns `<prefix>/...` metrics: the losses (`sum_keys`: each
        mini-batch's global mean loss, averaged over the mini-batches and epochs, as verl's), the grad
        norm (averaged over the mini-batches and epochs) and the statistics (`LossTerms.means`), every
        rank's (a clip fraction is not rank 0's alone): with `per_mini_batch` each mini-batch's mean
        over its micro-batches of every rank, combined over the mini-batches and epochs (verl's actor:
        its policy-loss metrics are `Metric`s of aggregation MEAN; a key holding "max" or "min" takes
        the largest or smallest mini-batch figure, as verl's `reduce_metrics`), else the mean over every
        micro-batch of every mini-batch and rank (verl's critic: plain floats), `_Mean`."""
        steps = cfg.ppo_epochs * num_mini_batches
        stats = _Mean(steps)
        ro, _ = pool_rows(ro, self.sp)
        batching = sp_batching(MicroBatching(cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                             cfg.ppo_max_token_len_per_gpu), self.sp)
        plan = plan_update(ro, cfg.ppo_epochs, num_mini_batches, cfg.shuffle, seed, *batching, self.sp_size,
                           self.share_prefix)
        totals = dict.fromkeys(sum_keys, torch.zeros((), device=self.device))
        for k, mb in enumerate(plan):
            # the data-parallel size: the groups, each of whose ranks computes its group's loss
            agg_kw = _agg_kwargs(mb.global_tokens, mb.global_seqs, self.world_size // self.sp_size,
                                 loss_scale_factor or self.response_length)
            with keep_compute_copies(self.model):  # the masters change only in the step below
                for j, part in enumerate(mb.parts):
                    # The replicas' gradients are reduced once, in the mini-batch's last backward
                    # (every rank runs as many micro-batches: `plan_update`).
                    with nullcontext() if j == len(mb.parts) - 1 else no_gradient_sync(self.model):
                        sub = ro.take(part)
                        outputs = forward(sub, k)
                        if not part:  # no sequences here: a zero loss keeps FSDP's collectives in step
                            if join is not None:
                                join()
                            (outputs[0].sum() * 0.0).backward()
                            continue
                        terms = loss(sub, outputs, k, agg_kw)
                        terms.loss.backward()
                    for key, v in terms.sums.items():
                        totals[key] = totals[key] + v
                    stats.add(k if per_mini_batch else 0, **terms.means)
            grad_norm, skipped = _grad_norm_and_step(self.model, self.optimizer, cfg.grad_clip, step)
            stats.add(k, **{f"{prefix}/grad_norm": grad_norm, f"{prefix}/nonfinite_skipped": skipped})
        # each mini-batch's global-mean loss, averaged over the mini-batches of every epoch
        stats.add(0, **{key: total / steps for key, total in totals.items()})
        out = stats.result()
        # a count of the skipped optimizer steps, not their share (one flag was added per step)
        out[f"{prefix}/nonfinite_skipped"] = out[f"{prefix}/nonfinite_skipped"] * steps
        out[f"{prefix}/lr"] = self.optimizer.param_groups[0]["lr"]
        return out


class Reference(Protocol):
    """The reference role: log-probs `[N, R]` of this rank's responses under the reference policy.

    `ReferencePolicy` is a separate frozen copy of the initial model; `AdaptersOffReference` is
    an actor trained with LoRA adapters with the adapters switched off."""

    def log_probs(self, ro: RolloutBatch) -> torch.Tensor: ...


class Actor(TrainableRole):
    """The policy being trained: old log-probs and entropy before the update, and the update."""

    def __init__(self, model, optimizer, scheduler, *, temperature: float, router_replay: str = "disabled", **kw):
        super().__init__(model, optimizer, scheduler, **kw)
        self.temperature = temperature
        # actor.router_replay.mode (verl's): R3, the old-log-prob pass and the update replay the rollout's routed
        # experts; R2, the pass records its own routing (verl's RECORD) and the update replays it (REPLAY_FORWARD)
        self.router_replay = router_replay

    def _forward(self, sub: RolloutBatch, with_entropy: bool, with_sum_pi_squared: bool = False,
                 replay: bool = False, record: bool = False):
        """`replay`: the MoE layers replay the rows' `routed_experts`; `record`: the outputs end with the forward's
        `RoutingRecord`."""
        mb = self._micro_batch(sub, replay, record)
        return response_logprobs(self.model, mb, sub.width, self.temperature, with_entropy, with_sum_pi_squared)

    def log_probs(self, ro: RolloutBatch, with_entropy: bool = False, with_sum_pi_squared: bool = False):
        """(log-probs `[N, R]`, entropy `[N, R]` or None) of this rank's responses under the actor,
        and with `with_sum_pi_squared` a third, each token's sum of squared probabilities `[N, R]`
        (`actor.calculate_sum_pi_squared`): the old-log-prob pass. Under R3 it replays the rollout's
        `ro.routed_experts`; under R2 its routers route and it records their choice, every token's experts
        in each sparse layer, into `ro.routed_experts` (in place of any rollout record: R2 replays the
        actor's own routing), which the update then replays."""
        record = self.router_replay == "R2"
        outs = forward_micro_batches(ro, self.batching, lambda sub: self._forward(
            sub, with_entropy, with_sum_pi_squared, replay=self.router_replay == "R3", record=record),
                                     self.model, self.sp, self.share_prefix)
        if record:
            *outs, ro.routed_experts = outs
        return tuple(outs)

    def update(self, ro: RolloutBatch, cfg, num_mini_batches: int, kl_loss_coef: float, seed: int, step: int = -1,
               rollout_correction=None) -> dict:
        """PPO epochs × mini-batches × micro-batches of the policy loss (+ KL, entropy).

        The policy loss is `cfg.policy_loss.loss_mode`'s (`ppo.core_algos.POLICY_LOSSES`), with its
        parameters; in bypass mode `rollout_correction.loss_type`'s. A loss that draws random
        numbers (clip_cov) draws them from one generator per update, seeded by `loss_seed(seed,
        rank)`: a run repeats its draws.

        `rollout_correction` (`algorithm.rollout_correction`): in decoupled mode its weights
        and rejection were computed once per step (`ro.rollout_is_weights`, `ro.rollout_rs_mask`)
        and every term runs over `loss_mask`; in bypass mode they are computed here per
        micro-batch from pi_theta / pi_rollout (`rollout_log_probs`), with the `rollout_corr/`
        metrics, and the rejection removes tokens from the policy-gradient term only (entropy, KL
        loss and the normaliser keep the response mask, as verl's bypass loss).

        On-policy (one mini-batch, one epoch: a single optimizer step), outside bypass mode, the
        ratio's old log-probs are the update's own forward, detached (verl's `on_policy`): the
        ratio is exactly 1, not 1 up to the recompute pass's rounding. The trainer then skips
        that pass when nothing before the update needs it (`ro.old_log_probs` is None).

        Where the recompute pass did not run (bypass mode, or skipped on-policy), its metrics come
        from the first mini-batch, whose forwards run before any optimizer step and so see the
        actor that the pass would have used: `actor/entropy` (aggregated with `loss_agg_mode`, as
        the pass's), `rollout/logprob_diff` (when the engine's log-probs are at hand) and, when
        skipped on-policy, `actor/ref_kl` (with a reference).

        With `cfg.calculate_entropy` or an entropy bonus (verl's `calculate_entropy or
        entropy_coeff != 0`) the update computes its own entropy, `actor/entropy_loss` (each
        mini-batch's under the actor of its forwards, aggregated as the loss, averaged over the
        mini-batches and epochs), as verl 0.9.1's engine workers; `actor/entropy` stays the
        recompute pass's. `actor/loss` is the whole loss backpropagated (policy gradient, minus the
        entropy bonus, plus the KL loss), averaged as its terms, as verl's."""
        need_entropy = cfg.entropy_coeff != 0
        report_entropy = need_entropy or cfg.calculate_entropy
        rc = rollout_correction
        bypass = rc is not None and rc.bypass_mode
        normalize = bypass and rc.rollout_is is not None and rc.rollout_is_batch_normalize
        on_policy = num_mini_batches == 1 and cfg.ppo_epochs == 1 and not bypass
        from_update = bypass or ro.old_log_probs is None
        if ro.old_log_probs is None and not on_policy:
            raise ValueError("Actor.update needs old_log_probs unless it is on-policy (one mini-batch, one epoch)")
        # bypass mode trains with its own loss (`BYPASS_LOSS_TYPES`); the config refuses another loss_mode with it
        pl = cfg.policy_loss
        policy_loss = get_policy_loss_fn(BYPASS_LOSS_TYPES[rc.loss_type] if bypass else pl.loss_mode)
        loss_params = PolicyLossParams(pl.clip_cov_ratio, pl.clip_cov_lb, pl.clip_cov_ub, pl.kl_cov_ratio,
                                       pl.ppo_kl_coef, cfg.tau_pos, cfg.tau_neg, pl.dro_beta)
        # one stream per data-parallel group: the ranks of a Ulysses group compute one loss
        generator = torch.Generator(self.device).manual_seed(loss_seed(seed, self.dp_rank))
        # where the recompute pass did not run, over mini-batch 0: this rank's share of the entropy
        # aggregated as the loss (loss_agg_mode), the masked sums of |log-prob - engine log-prob| and of
        # the k3 KL to the reference, and the token count
        first = torch.zeros(4, dtype=torch.float64, device=self.device)
        sum_keys = (("actor/loss", "actor/pg_loss") + (("actor/kl_loss",) if cfg.use_kl_loss else ())
                    + (("actor/entropy_loss",) if report_entropy else ()))

        # routing replay: R3 the rollout's experts; R2 the old-log-prob pass's record, or, where an on-policy
        # update skipped the pass, none: its one optimizer step's forwards all run under pi_old, routing as it does
        replay = self.router_replay == "R3" or (self.router_replay == "R2" and ro.old_log_probs is not None)

        def forward(sub, k):
            return self._forward(sub, report_entropy or (from_update and k == 0), replay=replay)

        def loss(sub, outputs, k, agg_kw):
            nonlocal first
            logp, ent = outputs
            m_mask = sub.loss_mask
            pg_mask = m_mask
            means = {}
            if bypass:
                # batch_normalize: the mean over this micro-batch of every rank (as verl's actor)
                weights, keep, corr = compute_rollout_correction(
                    logp.detach(), sub.rollout_log_probs, m_mask, rc.rollout_is, *rc.is_bounds, rc.rejection,
                    normalize, comm.all_reduce)
                pg_mask = m_mask if keep is None else keep
                means.update(corr)
                if rc.loss_type == "ppo_clip":  # its ratio pi_theta / pi_rollout is the IS weight: the weights
                    weights = None              # give metrics only (as in verl)
            else:
                weights = sub.rollout_is_weights
            if from_update and k == 0:
                first += self._pre_update_sums(sub, logp.detach(), ent.detach(), m_mask, cfg.loss_agg_mode, agg_kw,
                                               with_ref_kl=not bypass)
            pg = policy_loss(
                old_log_prob=logp.detach() if on_policy else sub.old_log_probs, log_prob=logp, advantages=sub.advantages,
                response_mask=pg_mask, cliprange=cfg.clip_ratio, cliprange_low=cfg.clip_ratio_low,
                cliprange_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                loss_agg_mode=cfg.loss_agg_mode, rollout_is_weights=weights, loss_params=loss_params,
                generator=generator, **agg_kw)
            total = pg.pg_loss
            sums = {"actor/pg_loss": pg.pg_loss.detach()}
            if report_entropy:
                ent_loss = agg_loss(ent, m_mask, cfg.loss_agg_mode, **agg_kw)
                sums["actor/entropy_loss"] = ent_loss.detach()
            if need_entropy:
                total = total - cfg.entropy_coeff * ent_loss
            if cfg.use_kl_loss:
                kld = kl_penalty(logp, sub.ref_log_probs, cfg.kl_loss_type)
                kl_loss = agg_loss(kld, m_mask, cfg.loss_agg_mode, **agg_kw)
                total = total + kl_loss_coef * kl_loss
                sums["actor/kl_loss"] = kl_loss.detach()
            sums["actor/loss"] = total.detach()
            means.update({"actor/pg_clipfrac": pg.pg_clipfrac, "actor/ppo_kl": pg.ppo_kl,
                          "actor/pg_clipfrac_lower": pg.pg_clipfrac_lower})
            return LossTerms(total, sums, means)

        def join():  # the normalising sum of an empty micro-batch
            comm.all_reduce(torch.zeros(2, dtype=torch.float64, device=self.device))

        out = self._update(ro, cfg, num_mini_batches, seed, "actor", forward, loss, sum_keys, step=step,
                           loss_scale_factor=cfg.loss_scale_factor, join=join if normalize else None,
                           per_mini_batch=True)
        if from_update:
            # every rank of a Ulysses group added its group's shares
            entropy, diff_sum, kl_sum, tokens = (x / self.sp_size for x in comm.all_reduce(first).tolist())
            out["actor/entropy"] = entropy
            if ro.rollout_log_probs is not None:
                out["rollout/logprob_diff"] = diff_sum / max(tokens, 1.0)
            if not bypass and ro.ref_log_probs is not None:
                out["actor/ref_kl"] = kl_sum / max(tokens, 1.0)
        return out


    @staticmethod
    def _pre_update_sums(sub: RolloutBatch, logp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor,
                         loss_agg_mode: str, agg_kw: dict, with_ref_kl: bool) -> torch.Tensor:
        """One micro-batch's share of the recompute pass's metrics (see `update`): the entropy
        aggregated as the loss, the masked sums of |log-prob - engine log-prob| and of the k3 KL
        to the reference (zero where there is none), and the token count, as float64."""
        zero = logp.new_zeros(())
        diff = masked_sum((logp - sub.rollout_log_probs).abs(), mask) if sub.rollout_log_probs is not None else zero
        kl = (masked_sum(kl_penalty(logp, sub.ref_log_probs, "low_var_kl"), mask)
              if with_ref_kl and sub.ref_log_probs is not None else zero)
        entropy = agg_loss(ent, mask, loss_agg_mode, **{**agg_kw, "dp_size": 1})
        return torch.stack([entropy, diff, kl, mask.sum().to(logp.dtype)]).double()


class ReferencePolicy(Role):
    """The reference as a frozen copy of the initial policy (`Reference`)."""

    def __init__(self, model, *, temperature: float, **kw):
        super().__init__(model, **kw)
        self.temperature = temperature
        self.offload()  # waits in host memory until its phase (param_offload)

    def log_probs(self, ro: RolloutBatch) -> torch.Tensor:
        with self.resident(with_optimizer=False):
            logp, _ = forward_micro_batches(ro, self.batching, lambda sub: response_logprobs(
                self.model, self._micro_batch(sub), sub.width, self.temperature, with_entropy=False), self.model,
                self.sp, self.share_prefix)
        return logp


class AdaptersOffReference:
    """The reference of a LoRA actor (`Reference`): the actor's own base weights with its adapters
    off, no second model. Runs while the actor is resident (between generation and the update);
    forward-only, as `models.lora.adapters_disabled` requires."""

    def __init__(self, actor: Actor, batching: MicroBatching):
        if not lora_modules(actor.model):
            raise ValueError("AdaptersOffReference needs an actor with LoRA adapters")
        self.actor, self.batching = actor, batching

    def log_probs(self, ro: RolloutBatch) -> torch.Tensor:
        with torch.no_grad(), adapters_disabled(self.actor.model):
            logp, _ = forward_micro_batches(ro, self.batching, lambda sub: self.actor._forward(sub, with_entropy=False,
                                                                                          replay=False),
                                            self.actor.model, self.actor.sp, self.actor.share_prefix)
        return logp


class Critic(TrainableRole):
    """The value model: values of the states before each response token, and its update."""

    def __init__(self, model, optimizer, scheduler, **kw):
        super().__init__(model, optimizer, scheduler, **kw)
        self.offload()  # waits in host memory until its phases (param_offload / optimizer_offload)

    def _forward(self, sub: RolloutBatch):
        return response_values(self.model, self._micro_batch(sub), sub.width)

    def values(self, ro: RolloutBatch) -> torch.Tensor:
        """Values `[N, R]` of this rank's response tokens (0 on padding)."""
        with self.resident(with_optimizer=False):
            values, = forward_micro_batches(ro, self.batching, lambda sub: (self._forward(sub),), self.model, self.sp)
        return values * ro.response_mask

    def update(self, ro: RolloutBatch, cfg, num_mini_batches: int, seed: int) -> dict:
        """PPO epochs × mini-batches × micro-batches of the clipped value loss, over `loss_mask`
        (rollout rejection's tokens left out, as in verl's critic), aggregated by `cfg.loss_agg_mode`
        (seq-mean-token-sum-norm's divisor `cfg.loss_scale_factor`, else the response length)."""

        def loss(sub, outputs, k, agg_kw):
            vf = compute_value_loss(outputs[0], sub.returns, sub.values, sub.loss_mask,
                                    cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **agg_kw)
            # verl's vpred_mean: each micro-batch's mean value over its loss tokens (verl's response_mask,
            # which rollout rejection has overwritten by then, as vf_loss's), averaged
            return LossTerms(vf.vf_loss, {"critic/vf_loss": vf.vf_loss.detach()},
                             {"critic/vf_clipfrac": vf.vf_clipfrac,
                              "critic/vpred_mean": masked_mean(outputs[0].detach(), sub.loss_mask)})

        with self.resident(with_optimizer=True):
            out = self._update(ro, cfg, num_mini_batches, seed, "critic", lambda sub, k: (self._forward(sub),),
                               loss, ("critic/vf_loss",), loss_scale_factor=cfg.loss_scale_factor)
        out["critic/loss"] = out["critic/vf_loss"]  # verl's: the loss backpropagated, here the value loss alone
        return out


class RewardModel(Role):
    """A value-head model whose output at a sequence's last token is its score. `inputs`
    (`rewards.model_inputs.RewardModelInputs`) renders each chat with the model's own tokenizer
    first; None: it reads the prompt and response token ids as they are."""

    def __init__(self, model, *, inputs=None, **kw):
        super().__init__(model, **kw)
        self.inputs = inputs
        self.offload()  # waits in host memory until its phase (param_offload)

    def model_batch(self, ro: RolloutBatch) -> RolloutBatch:
        """`ro` as the model reads it: each chat rendered with its own tokenizer and template (`inputs`), or as is."""
        if self.inputs is None:
            return ro
        return RolloutBatch.sequences(self.inputs(ro.raw_prompts, ro.responses), ro.device)

    def scores(self, ro: RolloutBatch) -> torch.Tensor:
        """Scores `[N]` of this rank's sequences, `ro` from `model_batch`."""
        with self.resident(with_optimizer=False):
            scores, = forward_micro_batches(ro, self.batching,
                                            lambda sub: (last_token_scores(self.model, self._micro_batch(sub)),),
                                            self.model, self.sp)
        return scores


def loss_seed(seed: int, rank: int) -> int:
    """The seed of a rank's policy-loss generator in an update of seed `seed` (the trainer's: trainer.seed
    + the step): distinct streams for distinct (seed, rank)."""
    return int(np.random.SeedSequence((seed, rank)).generate_state(1, np.uint64)[0])


def _agg_kwargs(global_tokens: float, global_seqs: float, world_size: int, loss_scale_factor: float) -> dict:
    # seq-mean-token-sum-norm divides by a constant length (Dr. GRPO): actor.loss_scale_factor or the
    # configured response length, not the micro-batch's padding width, so packing cannot change the gradient.
    return {"global_num_tokens": max(global_tokens, 1.0), "global_num_seqs": max(global_seqs, 1.0),
            "dp_size": world_size, "loss_scale_factor": float(loss_scale_factor)}


def agg_loss_global(values: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str, loss_scale_factor: float) -> float:
    """`ppo.core_algos.agg_loss` of every rank's rows together, as verl aggregates a metric over the
    whole batch (`actor/entropy`): the global count of loss units, then the ranks' shares summed
    (two collectives)."""
    tokens, seqs = comm.all_reduce_values([count_loss_units(mask, mode) for mode in ("token-mean",
                                                                                    "seq-mean-token-mean")])
    share = agg_loss(values, mask, loss_agg_mode, **_agg_kwargs(tokens, seqs, 1, loss_scale_factor))
    return comm.all_reduce_values([float(share)])[0]


def masked_mean_global(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over all ranks' masked entries (one collective)."""
    s, c = comm.all_reduce_values([float((values * mask).sum()), float(mask.sum())])
    return s / max(c, 1.0)


__all__ = ["Actor", "AdaptersOffReference", "Critic", "MicroBatching", "Reference", "ReferencePolicy", "RewardModel",
           "forward_micro_batches",
           "plan_micro_batches", "agg_loss_global", "masked_mean_global"]
