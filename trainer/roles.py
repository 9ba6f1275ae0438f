"""Actor, reference and critic computations on this rank's rollouts.

Each worker wraps one FSDP2-sharded model. Forward-only passes (old log-probs, reference
log-probs, values) run in micro-batches without gradients; updates run PPO epochs ×
mini-batches × micro-batches with the loss normalised to the global token (or sequence)
mean of the mini-batch, so the gradient does not depend on how sequences were packed into
micro-batches or spread over ranks (`ppo.core_algos.agg_loss`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kl import kl_penalty
from trainer import faults
from trainer.batching import token_budget_partitions
from ppo.core_algos import (agg_loss, compute_rollout_correction, compute_value_loss, count_loss_units,
                            get_policy_loss_fn, masked_sum)
from trainer.forward import build_micro_batch, response_logprobs, response_values
from trainer.rollout_batch import RolloutBatch
from sharding import comm
from sharding.fsdp import load_states, offload_states
from sharding.grad_norm import clip_grad_norm_


@contextmanager
def resident(model, optimizer, fsdp_cfg, device):
    """Bring offloaded parameters / optimizer states (fsdp_config.param_offload /
    optimizer_offload) to the device for one phase and send them back after it."""
    if fsdp_cfg is None:
        yield
        return
    load_states(model, optimizer, fsdp_cfg, device)
    try:
        yield
    finally:
        offload_states(model, optimizer, fsdp_cfg)


def plan_micro_batches(indices: list[int], lengths: list[int], micro_size: int | None, dynamic: bool,
                       max_tokens: int) -> list[list[int]]:
    """Split `indices` (of this rank) into micro-batches; every rank gets the same count.

    Fixed size: ranks hold equally many sequences, so the count already agrees. Dynamic:
    pack by token budget, then agree on the largest count over ranks and rebalance into it.
    """
    return _plan([indices], lengths, micro_size, dynamic, max_tokens)[0]


def _plan(batches: list[list[int]], lengths: list[int], micro_size: int | None, dynamic: bool,
          max_tokens: int) -> list[list[list[int]]]:
    """`plan_micro_batches` for several batches with one collective (dynamic sizes only)."""
    if not dynamic:
        out = []
        for indices in batches:
            size = micro_size or len(indices)
            out.append([indices[s:s + size] for s in range(0, len(indices), size)] or [[]])
        return out
    costs = [[lengths[i] for i in indices] for indices in batches]
    parts = [token_budget_partitions(c, max_tokens) for c in costs]
    if comm.world_size() > 1:
        counts = comm.all_reduce_values([len(p) for p in parts], "max")
        parts = [token_budget_partitions(c, max_tokens, min_parts=int(n)) for c, n in zip(costs, counts)]
    return [[[indices[j] for j in p] for p in ps] for indices, ps in zip(batches, parts)]


@dataclass
class MiniBatch:
    """One optimizer step of an update: this rank's micro-batches and the loss units (tokens or
    sequences) of the whole mini-batch summed over every rank, for the global-mean loss."""

    parts: list[list[int]]
    global_units: float


def plan_update(ro: RolloutBatch, epochs: int, num_mini_batches: int, shuffle: bool, seed: int, loss_agg_mode: str,
                micro_size: int | None, dynamic: bool, max_tokens: int) -> list[MiniBatch]:
    """Every mini-batch of every epoch, planned before the first forward with two collectives
    (the loss units and the micro-batch counts), so that the update loop itself never waits
    for the host: a collective read back inside it would drain the GPU queue each mini-batch."""
    n = len(ro)
    mini = n // num_mini_batches
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).tolist() if shuffle else list(range(n))
        batches += [order[m * mini:(m + 1) * mini] for m in range(num_mini_batches)]
    mask = ro.response_mask.cpu()  # one copy instead of a read-back per mini-batch
    units = comm.all_reduce_values([count_loss_units(mask[idx], loss_agg_mode) for idx in batches])
    plans = _plan(batches, ro.lengths(), micro_size, dynamic, max_tokens)
    return [MiniBatch(parts, u) for parts, u in zip(plans, units)]


def _grad_norm_and_step(model, optimizer, grad_clip: float, step: int = -1):
    """Clip the global grad norm and step only if it is finite; returns (norm, skipped) as 0-dim
    tensors. Every rank sees the same norm (it is reduced over all shards), so a skip is
    consistent without extra communication. Fused optimizers take the skip as a device flag
    (`found_inf`, as under a GradScaler: no update, no step count), so nothing waits for the
    host; others read the norm back."""
    faults.poison_grads(model, step, comm.rank())
    norm = clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    if optimizer.defaults.get("fused"):
        skipped = (~torch.isfinite(norm)).float()
        optimizer.found_inf = skipped
        optimizer.step()
    else:
        skipped = torch.tensor(0.0 if math.isfinite(float(norm)) else 1.0)
        if not skipped:
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


class _Mean:
    """Averages metrics over micro-/mini-batches. Values may be device tensors: they are only
    read back in `result()` (one host sync), never inside the update loop."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def add(self, **kv):
        for k, v in kv.items():
            self.values.setdefault(k, []).append(v.detach().float().reshape(()) if torch.is_tensor(v) else float(v))

    def result(self, rank_means: tuple[str, ...] = ()) -> dict[str, float]:
        """Means over the added values; the keys in `rank_means` are also averaged over ranks
        (one collective for all of them)."""
        means = [torch.stack(vs).mean() if torch.is_tensor(vs[0]) else torch.tensor(sum(vs) / len(vs))
                 for vs in self.values.values()]
        dev = next((m.device for m in means if m.device.type != "cpu"), torch.device("cpu"))
        local = torch.stack([m.to(dev) for m in means]).tolist() if means else []
        out = dict(zip(self.values, local))
        keys = [k for k in rank_means if k in out]
        for k, v in zip(keys, comm.all_reduce_values([out[k] for k in keys])):
            out[k] = v / comm.world_size()
        return out


class PolicyWorker:
    """The actor (trainable) or the reference policy (`optimizer=None`)."""

    def __init__(self, model, optimizer=None, scheduler=None, *, packed: bool, temperature: float, pad_token_id: int,
                 device: torch.device, world_size: int, response_length: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.response_length = response_length
        self.packed, self.temperature, self.pad = packed, temperature, pad_token_id
        self.device, self.world_size = device, world_size

    def scale_lr(self, next_lr) -> None:
        """Apply `next_lr` to the learning rate now and to the schedule's base (a KL guard's
        `lower_lr`)."""
        self.scheduler.base_lrs = [next_lr(lr) for lr in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["lr"] = next_lr(group["lr"])

    def _forward(self, ro: RolloutBatch, idx: list[int], with_entropy: bool):
        sub = ro.take(idx)
        mb = build_micro_batch(sub.prompts, sub.responses, self.device, self.packed, self.pad)
        return response_logprobs(self.model, mb, ro.width, self.temperature, with_entropy)

    @torch.no_grad()
    def compute_log_prob(self, ro: RolloutBatch, micro_size, dynamic, max_tokens, with_entropy=False):
        """Log-probs `[N, R]` (and entropy) of this rank's responses under the model."""
        logp = torch.zeros(len(ro), ro.width, device=self.device)
        ent = torch.zeros(len(ro), ro.width, device=self.device) if with_entropy else None
        lengths = ro.lengths()
        for part in plan_micro_batches(list(range(len(ro))), lengths, micro_size, dynamic, max_tokens):
            lp, en = self._forward(ro, part, with_entropy)
            if part:
                rows = ro.index(part)
                logp[rows] = lp
                if with_entropy:
                    ent[rows] = en
        return logp, ent

    def update(self, ro: RolloutBatch, cfg, num_mini_batches: int, kl_loss_coef: float, seed: int, step: int = -1,
               rollout_correction=None) -> dict:
        """PPO epochs × mini-batches × micro-batches of the clipped policy loss (+ KL, entropy).

        `rollout_correction` (`algorithm.rollout_correction`): in decoupled mode its weights
        were computed once per step (`ro.rollout_is_weights`); in bypass mode they
        are computed here per micro-batch from pi_theta / pi_rollout (`rollout_log_probs`),
        with the `rollout_corr/` metrics, and `actor/entropy` and `rollout/logprob_diff` come
        from the first mini-batch: its forwards run before any optimizer step, so they see the
        actor that the skipped recompute pass would have used."""
        stats = _Mean()
        plan = plan_update(ro, cfg.ppo_epochs, num_mini_batches, cfg.shuffle, seed, cfg.loss_agg_mode,
                           cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu)
        need_entropy = cfg.entropy_coeff != 0
        rc = rollout_correction
        bypass = rc is not None and rc.bypass_mode
        policy_loss = get_policy_loss_fn(rc.loss_type if rc is not None else "ppo_clip")
        # bypass mode: masked sums of entropy and |log-prob - engine log-prob|, and the token count, over mini-batch 0
        first = torch.zeros(3, dtype=torch.float64, device=self.device)
        sums = ("actor/pg_loss", "actor/kl_loss", "actor/entropy_loss")
        for k, mb in enumerate(plan):
            agg_kw = _agg_kwargs(cfg.loss_agg_mode, mb.global_units, self.world_size, self.response_length)
            totals = dict.fromkeys(sums, torch.zeros((), device=self.device))
            before_step = bypass and k == 0
            for part in mb.parts:
                logp, ent = self._forward(ro, part, need_entropy or before_step)
                if not part:  # no sequences here: a zero loss keeps FSDP's collectives in step
                    (logp.sum() * 0.0).backward()
                    continue
                sub = ro.take(part)
                m_mask = sub.response_mask
                if bypass:
                    rollout_lp = sub.rollout_log_probs
                    weights, corr = compute_rollout_correction(
                        logp.detach(), rollout_lp, m_mask, rc.rollout_is, *rc.is_bounds, rc.rejection)
                    stats.add(**corr)
                    if before_step:
                        first += torch.stack([masked_sum(ent.detach(), m_mask), masked_sum(
                            (logp.detach() - rollout_lp).abs(), m_mask), m_mask.sum()]).double()
                else:
                    weights = sub.rollout_is_weights
                pg = policy_loss(
                    old_log_prob=sub.old_log_probs, log_prob=logp, advantages=sub.advantages,
                    response_mask=m_mask, cliprange=cfg.clip_ratio, cliprange_low=cfg.clip_ratio_low,
                    cliprange_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                    loss_agg_mode=cfg.loss_agg_mode, rollout_is_weights=weights, **agg_kw)
                loss = pg.pg_loss
                if need_entropy:
                    ent_loss = agg_loss(ent, m_mask, cfg.loss_agg_mode, **agg_kw)
                    loss = loss - cfg.entropy_coeff * ent_loss
                    totals["actor/entropy_loss"] = totals["actor/entropy_loss"] + ent_loss.detach()
                if cfg.use_kl_loss:
                    kld = kl_penalty(logp, sub.ref_log_probs, cfg.kl_loss_type)
                    kl_loss = agg_loss(kld, m_mask, cfg.loss_agg_mode, **agg_kw)
                    loss = loss + kl_loss_coef * kl_loss
                    totals["actor/kl_loss"] = totals["actor/kl_loss"] + kl_loss.detach()
                loss.backward()
                totals["actor/pg_loss"] = totals["actor/pg_loss"] + pg.pg_loss.detach()
                stats.add(**{"actor/pg_clipfrac": pg.pg_clipfrac, "actor/ppo_kl": pg.ppo_kl,
                             "actor/pg_clipfrac_lower": pg.pg_clipfrac_lower})
            grad_norm, skipped = _grad_norm_and_step(self.model, self.optimizer, cfg.grad_clip, step)
            stats.add(**totals)
            stats.add(**{"actor/grad_norm": grad_norm, "actor/nonfinite_skipped": skipped})
        corr_keys = tuple(k for k in stats.values if k.startswith("rollout_corr/"))
        out = stats.result(rank_means=sums + corr_keys)
        if bypass:
            ent_sum, diff_sum, tokens = comm.all_reduce(first).tolist()
            out["actor/entropy"] = ent_sum / max(tokens, 1.0)
            out["rollout/logprob_diff"] = diff_sum / max(tokens, 1.0)
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/nonfinite_skipped"] = out["actor/nonfinite_skipped"] * len(plan)
        if not cfg.use_kl_loss:
            out.pop("actor/kl_loss")
        if cfg.entropy_coeff == 0:
            out.pop("actor/entropy_loss")
        return out


class ValueWorker:
    """The critic: values of the states before each response token, and its update."""

    def __init__(self, model, optimizer, scheduler, *, packed: bool, pad_token_id: int, device, world_size: int,
                 response_length: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.response_length = response_length
        self.packed, self.pad, self.device, self.world_size = packed, pad_token_id, device, world_size

    scale_lr = PolicyWorker.scale_lr

    def _forward(self, ro: RolloutBatch, idx):
        sub = ro.take(idx)
        mb = build_micro_batch(sub.prompts, sub.responses, self.device, self.packed, self.pad)
        return response_values(self.model, mb, ro.width)

    @torch.no_grad()
    def compute_values(self, ro: RolloutBatch, micro_size, dynamic, max_tokens) -> torch.Tensor:
        values = torch.zeros(len(ro), ro.width, device=self.device)
        for part in plan_micro_batches(list(range(len(ro))), ro.lengths(), micro_size, dynamic, max_tokens):
            v = self._forward(ro, part)
            if part:
                values[ro.index(part)] = v
        return values * ro.response_mask

    def update(self, ro: RolloutBatch, cfg, num_mini_batches: int, seed: int) -> dict:
        stats = _Mean()
        plan = plan_update(ro, cfg.ppo_epochs, num_mini_batches, cfg.shuffle, seed, cfg.loss_agg_mode,
                           cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu)
        for mb in plan:
            agg_kw = _agg_kwargs(cfg.loss_agg_mode, mb.global_units, self.world_size, self.response_length)
            vf_sum = torch.zeros((), device=self.device)
            for part in mb.parts:
                vpreds = self._forward(ro, part)
                if not part:
                    (vpreds.sum() * 0.0).backward()
                    continue
                sub = ro.take(part)
                vf = compute_value_loss(
                    vpreds, sub.returns, sub.values, sub.response_mask,
                    cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **agg_kw)
                vf.vf_loss.backward()
                vf_sum = vf_sum + vf.vf_loss.detach()
                stats.add(**{"critic/vf_clipfrac": vf.vf_clipfrac})
            grad_norm, skipped = _grad_norm_and_step(self.model, self.optimizer, cfg.grad_clip)
            stats.add(**{"critic/vf_loss": vf_sum, "critic/grad_norm": grad_norm, "critic/nonfinite_skipped": skipped})
        out = stats.result(rank_means=("critic/vf_loss",))
        out["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return out


def _agg_kwargs(mode: str, global_units: float, world_size: int, response_length: int) -> dict:
    key = "global_num_tokens" if mode == "token-mean" else "global_num_seqs"
    # seq-mean-token-sum-norm divides by a constant length (Dr. GRPO): the configured one, not
    # the micro-batch's padding width, so packing cannot change the gradient.
    return {key: max(global_units, 1.0), "dp_size": world_size, "loss_scale_factor": float(response_length)}


def masked_mean_global(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over all ranks' masked entries (one collective)."""
    s, c = comm.all_reduce_values([float((values * mask).sum()), float(mask.sum())])
    return s / max(c, 1.0)


__all__ = ["PolicyWorker", "ValueWorker", "plan_micro_batches", "masked_mean_global", "resident"]
