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

import torch

from kl import kl_penalty
from ppo import faults
from ppo.batching import token_budget_partitions
from ppo.core_algos import agg_loss, compute_policy_loss, compute_value_loss, count_loss_units
from ppo.forward import build_micro_batch, response_logprobs, response_values
from ppo.rollout_data import Rollouts
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
    if not dynamic:
        size = micro_size or len(indices)
        return [indices[s:s + size] for s in range(0, len(indices), size)] or [[]]
    costs = [lengths[i] for i in indices]
    parts = token_budget_partitions(costs, max_tokens)
    if comm.world_size() > 1:
        n = int(comm.all_reduce_values([len(parts)], "max")[0])
        parts = token_budget_partitions(costs, max_tokens, min_parts=n)
    return [[indices[j] for j in p] for p in parts]


def _grad_norm_and_step(model, optimizer, grad_clip: float, step: int = -1) -> tuple[float, bool]:
    """Clip the global grad norm; step only if it is finite. Every rank sees the same norm
    (it is reduced over all shards), so a skip is consistent without extra communication."""
    faults.poison_grads(model, step, comm.rank())
    norm = float(clip_grad_norm_(model.parameters(), max_norm=grad_clip))
    finite = math.isfinite(norm)
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm, finite


class _Mean:
    """Averages metrics over micro-/mini-batches. Values may be device tensors: they are
    only read back (one host sync) in `result()`, never inside a micro-batch."""

    def __init__(self):
        self.values: dict[str, list] = {}

    def add(self, **kv):
        for k, v in kv.items():
            self.values.setdefault(k, []).append(v.detach().float().reshape(()) if torch.is_tensor(v) else float(v))

    def result(self) -> dict[str, float]:
        out = {}
        for k, vs in self.values.items():
            out[k] = float(sum(float(v) for v in vs)) / len(vs) if vs and not torch.is_tensor(vs[0]) \
                else float(torch.stack([torch.as_tensor(v) for v in vs]).mean())
        return out


class PolicyWorker:
    """The actor (trainable) or the reference policy (`optimizer=None`)."""

    def __init__(self, model, optimizer=None, scheduler=None, *, packed: bool, temperature: float, pad_token_id: int,
                 device: torch.device, world_size: int, response_length: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.response_length = response_length
        self.packed, self.temperature, self.pad = packed, temperature, pad_token_id
        self.device, self.world_size = device, world_size

    def _forward(self, ro: Rollouts, idx: list[int], with_entropy: bool):
        prompts, responses = ro.select(idx)
        mb = build_micro_batch(prompts, responses, self.device, self.packed, self.pad)
        return response_logprobs(self.model, mb, ro.width, self.temperature, with_entropy)

    @torch.no_grad()
    def compute_log_prob(self, ro: Rollouts, micro_size, dynamic, max_tokens, with_entropy=False):
        """Log-probs `[N, R]` (and entropy) of this rank's responses under the model."""
        logp = torch.zeros(len(ro), ro.width, device=self.device)
        ent = torch.zeros(len(ro), ro.width, device=self.device) if with_entropy else None
        lengths = ro.lengths()
        for part in plan_micro_batches(list(range(len(ro))), lengths, micro_size, dynamic, max_tokens):
            lp, en = self._forward(ro, part, with_entropy)
            if part:
                logp[part] = lp
                if with_entropy:
                    ent[part] = en
        return logp, ent

    def update(self, ro: Rollouts, cfg, num_mini_batches: int, kl_loss_coef: float, seed: int, step: int = -1) -> dict:
        """PPO epochs × mini-batches × micro-batches of the clipped policy loss (+ KL, entropy)."""
        mask = ro.response_mask
        stats = _Mean()
        n = len(ro)
        mini = n // num_mini_batches
        lengths = ro.lengths()
        gen = torch.Generator().manual_seed(seed)
        for epoch in range(cfg.ppo_epochs):
            order = torch.randperm(n, generator=gen).tolist() if cfg.shuffle else list(range(n))
            for m in range(num_mini_batches):
                mb_idx = order[m * mini:(m + 1) * mini]
                units = count_loss_units(mask[mb_idx], cfg.loss_agg_mode)
                g_units = comm.all_reduce_sum(units)
                agg_kw = _agg_kwargs(cfg.loss_agg_mode, g_units, self.world_size, self.response_length)
                parts = plan_micro_batches(mb_idx, lengths, cfg.ppo_micro_batch_size_per_gpu, cfg.use_dynamic_bsz,
                                           cfg.ppo_max_token_len_per_gpu)
                zero = torch.zeros((), device=self.device)
                sums = {"actor/pg_loss": zero, "actor/kl_loss": zero, "actor/entropy_loss": zero}
                for part in parts:
                    need_entropy = cfg.entropy_coeff != 0
                    logp, ent = self._forward(ro, part, need_entropy)
                    if not part:  # no sequences here: a zero loss keeps FSDP's collectives in step
                        (logp.sum() * 0.0).backward()
                        continue
                    m_mask = ro.rows("response_mask", part)
                    pg_loss, clipfrac, ppo_kl, clipfrac_lower = compute_policy_loss(
                        ro.rows("old_log_probs", part), logp, ro.rows("advantages", part), m_mask,
                        cliprange=cfg.clip_ratio, cliprange_low=cfg.clip_ratio_low,
                        cliprange_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                        loss_agg_mode=cfg.loss_agg_mode, **agg_kw)
                    loss = pg_loss
                    if need_entropy:
                        ent_loss = agg_loss(ent, m_mask, cfg.loss_agg_mode, **agg_kw)
                        loss = loss - cfg.entropy_coeff * ent_loss
                        sums["actor/entropy_loss"] = sums["actor/entropy_loss"] + ent_loss.detach()
                    if cfg.use_kl_loss:
                        kld = kl_penalty(logp, ro.rows("ref_log_probs", part), cfg.kl_loss_type)
                        kl_loss = agg_loss(kld, m_mask, cfg.loss_agg_mode, **agg_kw)
                        loss = loss + kl_loss_coef * kl_loss
                        sums["actor/kl_loss"] = sums["actor/kl_loss"] + kl_loss.detach()
                    loss.backward()
                    sums["actor/pg_loss"] = sums["actor/pg_loss"] + pg_loss.detach()
                    stats.add(**{"actor/pg_clipfrac": clipfrac, "actor/ppo_kl": ppo_kl,
                                 "actor/pg_clipfrac_lower": clipfrac_lower})
                grad_norm, finite = _grad_norm_and_step(self.model, self.optimizer, cfg.grad_clip, step)
                totals = comm.all_reduce_values([float(v) for v in sums.values()])
                stats.add(**{k: v / self.world_size for k, v in zip(sums, totals)})
                stats.add(**{"actor/grad_norm": grad_norm, "actor/nonfinite_skipped": 0.0 if finite else 1.0})
        out = stats.result()
        out["actor/lr"] = self.optimizer.param_groups[0]["lr"]
        out["actor/nonfinite_skipped"] = out["actor/nonfinite_skipped"] * (cfg.ppo_epochs * num_mini_batches)
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

    def _forward(self, ro: Rollouts, idx):
        prompts, responses = ro.select(idx)
        mb = build_micro_batch(prompts, responses, self.device, self.packed, self.pad)
        return response_values(self.model, mb, ro.width)

    @torch.no_grad()
    def compute_values(self, ro: Rollouts, micro_size, dynamic, max_tokens) -> torch.Tensor:
        values = torch.zeros(len(ro), ro.width, device=self.device)
        for part in plan_micro_batches(list(range(len(ro))), ro.lengths(), micro_size, dynamic, max_tokens):
            v = self._forward(ro, part)
            if part:
                values[part] = v
        return values * ro.response_mask

    def update(self, ro: Rollouts, cfg, actor_cfg, num_mini_batches: int, seed: int) -> dict:
        mask = ro.response_mask
        stats = _Mean()
        n, lengths = len(ro), ro.lengths()
        mini = n // num_mini_batches
        epochs = cfg.ppo_epochs or actor_cfg.ppo_epochs
        micro = cfg.ppo_micro_batch_size_per_gpu or actor_cfg.ppo_micro_batch_size_per_gpu
        gen = torch.Generator().manual_seed(seed)
        for epoch in range(epochs):
            order = torch.randperm(n, generator=gen).tolist() if cfg.shuffle else list(range(n))
            for m in range(num_mini_batches):
                mb_idx = order[m * mini:(m + 1) * mini]
                g_units = comm.all_reduce_sum(count_loss_units(mask[mb_idx], cfg.loss_agg_mode))
                agg_kw = _agg_kwargs(cfg.loss_agg_mode, g_units, self.world_size, self.response_length)
                vf_sum = torch.zeros((), device=self.device)
                for part in plan_micro_batches(mb_idx, lengths, micro, cfg.use_dynamic_bsz, cfg.ppo_max_token_len_per_gpu):
                    vpreds = self._forward(ro, part)
                    if not part:
                        (vpreds.sum() * 0.0).backward()
                        continue
                    vf_loss, vf_clipfrac = compute_value_loss(
                        vpreds, ro.rows("returns", part), ro.rows("values", part), ro.rows("response_mask", part),
                        cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode, **agg_kw)
                    vf_loss.backward()
                    vf_sum = vf_sum + vf_loss.detach()
                    stats.add(**{"critic/vf_clipfrac": vf_clipfrac})
                grad_norm, finite = _grad_norm_and_step(self.model, self.optimizer, cfg.grad_clip)
                stats.add(**{"critic/vf_loss": comm.all_reduce_sum(float(vf_sum)) / self.world_size,
                             "critic/grad_norm": grad_norm, "critic/nonfinite_skipped": 0.0 if finite else 1.0})
        out = stats.result()
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
