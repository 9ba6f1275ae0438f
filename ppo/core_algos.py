"""The RL maths of PPO for language models, as pure functions of tensors.

Advantage estimators (GAE and the critic-free group estimators), the policy losses (verl's
loss modes: PPO's clip, DPPO, GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO, DRO, CISPO) and the
clipped value loss, loss aggregation with global normalisation, rollout correction (importance
weights and rejection for the gap between the engine's and the trainer's log-probs). The
memory-bounded log-probability and entropy of the LM head live with the model
(``models/lm_head.py``). Names and signatures follow verl's
``verl/trainer/ppo/core_algos.py`` and ``rollout_corr_helper.py`` so that a verl user finds
what they expect (verl 0.9.1); where meshppo deviates (empty rows in ``agg_loss``'s sequence
count, the k1 rejection bounds), the docstring says so.

Shape notation: ``[B, T]`` is batch x response tokens; ``response_mask`` is 1 for real
response tokens and 0 for padding (and for observation tokens in multi-turn rollouts).
Masks are binary. Nothing here imports ``torch.distributed``: cross-rank counts are passed
in by the trainer (see ``agg_loss`` and ``count_loss_units``).

Interchangeable algorithms register by name (``register_adv_est``, ``register_policy_loss``)
and share one keyword signature per kind, so the trainer calls ``fn(**inputs)`` without
knowing which one it runs (as verl's ``core_algos.py``). Losses return named results.
"""

import inspect
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from models.scan import cumsum

GroupIndex = Sequence | np.ndarray | torch.Tensor

LOG_RATIO_BOUND = 20.0
"""Log-ratios of two policies are clamped to ``[-20, 20]`` before ``exp`` (finite in float32)."""


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over the positions where ``mask`` is 1.

    Masked-out entries are selected away rather than multiplied by zero, so padding that
    holds inf or NaN (e.g. the log-prob of a pad token) cannot leak into the result.

    Args:
        values: ``[B, T]`` (any shape).
        mask: same shape as ``values``, binary.
        axis: dimension to reduce; ``None`` reduces everything to a scalar.
    """
    valid = torch.where(mask.bool(), values, 0.0)
    return valid.sum() if axis is None else valid.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the positions where ``mask`` is 1; 0 where the mask is empty.

    Unlike verl, which divides by ``mask.sum() + 1e-8``, the division is exact; an empty
    mask (or an empty row when ``axis`` is given) gives 0 with a finite gradient.
    """
    total = masked_sum(values, mask, axis)
    bool_mask = mask.bool()
    count = (bool_mask.sum() if axis is None else bool_mask.sum(dim=axis)).to(total.dtype)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (a scalar).

    With ``unbiased`` the Bessel correction ``n / (n - 1)`` is applied, which needs at least
    two valid positions: fewer raise ``ValueError``, as in verl. That check reads the count
    on the host, which is fine once per step (advantage whitening) but not per micro-batch.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int(mask.bool().sum())
        if count == 0:
            raise ValueError("masked_var: the mask is empty; at least two elements must be 1.")
        if count == 1:
            raise ValueError("masked_var: the mask has a single element; the unbiased variance is undefined.")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise ``values`` to zero mean and unit variance over the masked positions.

    ``(values - mean) / sqrt(var + 1e-8)`` with the unbiased masked variance; with
    ``shift_mean=False`` the mean is added back (only the scale changes). Positions outside
    the mask are transformed too but carry no meaning.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _float_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 inputs are computed in float32; float64 (tests) stays float64.
    return torch.promote_types(dtype, torch.float32)


ADV_ESTIMATOR_INPUTS: tuple[str, ...] = (
    "token_level_rewards", "response_mask", "values", "index", "gamma", "lam", "norm_adv_by_std_in_grpo",
    "reward_baselines", "old_log_probs", "sum_pi_squared", "rollout_is_weights",
)
"""The keywords every advantage estimator accepts (``values`` is None without a critic,
``reward_baselines`` None but for ``remax``, which alone reads it); each uses the ones its
formula needs and says which it only accepts. ``old_log_probs``, ``sum_pi_squared`` and
``rollout_is_weights`` (None where the step has none) are read by the optimal-token-baseline
pair alone; the other estimators accept them and say nothing more of them."""

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
"""``algorithm.adv_estimator`` name -> function, filled by ``register_adv_est``."""


def _check_signature(fn: Callable, inputs: tuple[str, ...], kind: str) -> None:
    """Registered functions of one kind all accept the keywords ``inputs``, and any other
    parameter of theirs has a default, so a caller passes the same ``**inputs`` to whichever
    one it holds."""
    params = inspect.signature(fn).parameters
    missing = [k for k in inputs if k not in params]
    required = [k for k, p in params.items() if k not in inputs and p.default is inspect.Parameter.empty
                and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]
    if missing or required:
        raise TypeError(f"{kind} {fn.__name__} must accept the keywords {list(inputs)} (lacks {missing}) and "
                        f"need no other argument (needs {required})")


def _registrar(registry: dict, inputs: tuple[str, ...], kind: str, name: str) -> Callable:
    def decorator(fn):
        _check_signature(fn, inputs, kind)
        if name in registry:
            raise ValueError(f"{kind} {name!r} is already registered")
        registry[name] = fn
        return fn

    return decorator


def register_adv_est(name: str) -> Callable:
    """Register an advantage estimator under ``name``; it must accept every keyword of
    ``ADV_ESTIMATOR_INPUTS`` and return ``(advantages, returns)``, each ``[B, T]``."""
    return _registrar(ADV_ESTIMATORS, ADV_ESTIMATOR_INPUTS, "advantage estimator", name)


def _valid_slots(mask: torch.Tensor) -> torch.Tensor:
    """Each valid position's index among its row's valid positions (``mask`` boolean ``[B, T]``)."""
    return mask.long().cumsum(1) - 1


def _compact_valid(x: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Each row's values at its valid positions, moved to the front in order (``[B, T]``, zeros
    after them; masked entries, NaN included, never read): the layout in which a recursion that
    passes through masked positions "as if they were absent" runs over consecutive columns.
    ``slots``: ``_valid_slots(mask)``. No host sync (no boolean indexing)."""
    b, t = mask.shape
    out = torch.zeros(b, t + 1, dtype=x.dtype, device=x.device)  # masked entries all go to a spare column t, dropped
    return out.scatter_(1, torch.where(mask, slots, t), x)[:, :t]


def _expand_valid(compact: torch.Tensor, mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_compact_valid``: back to the valid positions, zero at the others."""
    return torch.where(mask, compact.gather(1, slots.clamp(min=0)), 0.0)


#: Columns per block of ``_discounted_suffix_sum``: a block is one ``[B, C] @ [C, C]`` product.
SUFFIX_BLOCK = 512


def _discounted_suffix_sum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """``y[:, j] = sum_{i >= j} discount^(i - j) x[:, i]`` in float64, i.e. the backward recursion
    ``y_j = x_j + discount * y_{j+1}``, as one matrix product per block of ``SUFFIX_BLOCK``
    columns (an upper-triangular matrix of powers of ``discount``) and a carry between blocks:
    a handful of kernels instead of a few per column (30 ms of launches for 256 columns on an
    H200, every rank doing the whole batch)."""
    b, t = x.shape
    x = x.double()
    y = torch.empty_like(x)
    if t == 0:
        return y
    c = min(SUFFIX_BLOCK, t)
    k = torch.arange(c, device=x.device, dtype=torch.float64)
    lag = k[None, :] - k[:, None]  # [i, j] = j - i
    powers = torch.where(lag >= 0, torch.pow(discount, lag.clamp(min=0)), 0.0)  # W[i, j] = d^(j - i), j >= i
    carry = None  # y at the first column after the current block
    for end in range(t, 0, -c):
        start = max(0, end - c)
        n = end - start
        block = x[:, start:end] @ powers[:n, :n].T  # sum over i >= j inside the block
        if carry is not None:
            block += carry[:, None] * torch.pow(discount, n - k[:n])  # d^(end - j) y_end
        y[:, start:end] = block
        carry = block[:, 0]
    return y


@register_adv_est("gae")
@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor | None,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    reward_baselines: torch.Tensor | None = None,
    *,
    index: GroupIndex | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation over the response tokens (Schulman et al. 2016,
    https://arxiv.org/abs/1506.02438), with verl's handling of masked positions.

    Backwards over ``t``::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where ``V_next`` and ``A_next`` are those of the next *valid* token (0 after the last):
    at a masked position neither is updated, so the recursion passes through masked
    positions (padding, or observation tokens inside a multi-turn response) as if they were
    absent. Returns are ``A + V`` before whitening; advantages are then whitened over the
    mask.

    Args:
        token_level_rewards: ``[B, T]`` per-token rewards (score on the last token, minus any
            in-reward KL penalty).
        values: ``[B, T]`` critic values V(s_t).
        response_mask: ``[B, T]`` binary.
        gamma: discount factor.
        lam: GAE lambda.
        index, norm_adv_by_std_in_grpo: accepted for the one signature
            (``ADV_ESTIMATOR_INPUTS``); GAE has no groups.

    Returns:
        ``(advantages, returns)``, each ``[B, T]`` in at least float32, zero outside the mask.
    """
    if values is None:
        raise ValueError("the gae advantage estimator needs values: a critic")
    dtype = _float_dtype(values.dtype)
    mask = response_mask.bool()
    slots = _valid_slots(mask)
    rewards = _compact_valid(token_level_rewards.double(), mask, slots)
    values_c = _compact_valid(values.double(), mask, slots)
    # over the valid tokens laid out consecutively, V_next is the next column's value (0 after the last)
    next_values = torch.nn.functional.pad(values_c[:, 1:], (0, 1))
    advantages_c = _discounted_suffix_sum(rewards + gamma * next_values - values_c, gamma * lam)
    advantages = _expand_valid(advantages_c, mask, slots)
    returns = _expand_valid(advantages_c + values_c, mask, slots).to(dtype)
    advantages = torch.where(mask, masked_whiten(advantages.to(dtype), mask), 0.0)
    return advantages, returns



def _group_ids(index: GroupIndex, batch_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group labels (uid strings, ints) to dense ids ``[B]`` in ``[0, G)``."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    labels = np.asarray(index)
    if labels.shape != (batch_size,):
        raise ValueError(f"index must hold one group id per row: expected shape ({batch_size},), got {labels.shape}")
    _, dense = np.unique(labels, return_inverse=True)
    dense = dense.reshape(-1)
    num_groups = int(dense.max()) + 1 if batch_size else 0
    return torch.as_tensor(dense, dtype=torch.long, device=device), num_groups


def _group_sums(x: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sums of the rows of ``x`` (``[B, ...]``) by group: ``[G, ...]``."""
    return torch.zeros((num_groups,) + x.shape[1:], dtype=x.dtype, device=x.device).index_add_(0, group, x)


def _group_mean_std(
    scores: torch.Tensor, group: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group size, mean and unbiased std, with verl's convention that a group of one
    has mean 0 and std 1 (its sample std is undefined)."""
    counts = _group_sums(torch.ones_like(scores), group, num_groups)
    mean = _group_sums(scores, group, num_groups) / counts
    sq_dev = _group_sums((scores - mean[group]) ** 2, group, num_groups)
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    singleton = counts == 1
    mean = torch.where(singleton, 0.0, mean)
    std = torch.where(singleton, 1.0, std)
    return counts[group], mean[group], std[group]


def _outcome_scores(token_level_rewards: torch.Tensor) -> torch.Tensor:
    # As in verl the whole row is summed, not only its masked part: an outcome reward sits on
    # one token, and an empty response's score must still count in its group's statistics.
    return token_level_rewards.to(_float_dtype(token_level_rewards.dtype)).sum(dim=-1)


@register_adv_est("grpo")
@torch.no_grad()
def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO's group-relative outcome advantage (Shao et al. 2024, https://arxiv.org/abs/2402.03300).

    For response ``i`` with score ``s_i = sum_t r_{i,t}`` in group ``g``::

        A_i = (s_i - mean_g) / (std_g + epsilon)     # norm_adv_by_std_in_grpo=True
        A_i =  s_i - mean_g                          # False: Dr. GRPO, https://arxiv.org/abs/2503.20783

    with the unbiased std; a group of size 1 uses mean 0 and std 1 (verl's convention).
    ``A_i`` is broadcast to every valid token of the response.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]`` binary.
        index: ``[B]`` group id of each row (numpy array of uid strings, ints, a list or a
            tensor); rows with equal ids are samples of the same prompt.
        epsilon: added to the std to avoid division by zero in uniform groups.
        norm_adv_by_std_in_grpo: divide by the group std.
        values, gamma, lam: accepted for the one signature; an outcome advantage is not
            discounted and has no critic.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask.
    """
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    _, mean, std = _group_mean_std(scores, group, num_groups)
    advantage = scores - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + epsilon)
    advantages = torch.where(response_mask.bool(), advantage[:, None], 0.0)
    return advantages, advantages


@register_adv_est("rloo")
@torch.no_grad()
def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out outcome advantage (Ahmadian et al. 2024, https://arxiv.org/abs/2402.14740).

    For a group of size ``n > 1``: ``A_i = s_i - (sum_{j != i} s_j) / (n - 1)``, the score
    minus the mean of the other samples; a group of size 1 keeps its raw score (verl).

    Args:
        token_level_rewards, response_mask, index: as in ``compute_grpo_outcome_advantage``.
        epsilon: accepted so all group estimators share one signature (verl's); the
            leave-one-out baseline divides by ``n - 1 >= 1`` and needs no epsilon.
        norm_adv_by_std_in_grpo, values, gamma, lam: accepted for the one signature
            (``ADV_ESTIMATOR_INPUTS``).

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask.
    """
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    counts = _group_sums(torch.ones_like(scores), group, num_groups)[group]
    group_totals = _group_sums(scores, group, num_groups)[group]
    leave_one_out = scores - (group_totals - scores) / (counts - 1).clamp(min=1)
    advantage = torch.where(counts > 1, leave_one_out, scores)
    advantages = torch.where(response_mask.bool(), advantage[:, None], 0.0)
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    *,
    values: torch.Tensor | None = None,
    index: GroupIndex | None = None,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (Hu 2025, https://arxiv.org/abs/2501.03262): discounted
    returns-to-go, whitened over the whole batch's valid tokens.

    ``G_t = r_t + gamma * G_next``, where ``G_next`` is the return of the next *valid* token
    (0 after the last). Masked positions follow GAE's rule: the running return passes
    through them unchanged and undiscounted, as if they were absent, so an outcome reward
    reaches the actions before an observation span of a multi-turn response (verl does the
    same since verl-project/verl#7300). Rewards at masked positions are ignored.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]`` binary.
        gamma: discount factor.
        values, index, lam, norm_adv_by_std_in_grpo: accepted for the one signature
            (``ADV_ESTIMATOR_INPUTS``).

    Returns:
        ``(advantages, returns)``: whitened and raw returns, ``[B, T]``, zero outside the mask.
    """
    mask = response_mask.bool()
    slots = _valid_slots(mask)
    rewards = _compact_valid(token_level_rewards.double(), mask, slots)
    returns = _expand_valid(_discounted_suffix_sum(rewards, gamma), mask, slots)
    returns = returns.to(_float_dtype(token_level_rewards.dtype))
    advantages = torch.where(mask, masked_whiten(returns, mask), 0.0)
    return advantages, returns


@register_adv_est("reinforce_plus_plus_baseline")
@torch.no_grad()
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, https://arxiv.org/abs/2501.03262).

    ``s_i - mean_g`` (mean 0 for a group of one) is broadcast over the response's valid
    tokens and then whitened over all valid tokens of the batch, so the scale comes from
    the batch rather than from each (small) group.

    Args:
        token_level_rewards, response_mask, index: as in ``compute_grpo_outcome_advantage``.
        epsilon: accepted so all group estimators share one signature (verl's); the batch
            whitening uses ``masked_whiten``'s own 1e-8.
        norm_adv_by_std_in_grpo, values, gamma, lam: accepted for the one signature
            (``ADV_ESTIMATOR_INPUTS``).

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask.
    """
    mask = response_mask.bool()
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    _, mean, _ = _group_mean_std(scores, group, num_groups)
    centred = torch.where(mask, (scores - mean)[:, None], 0.0)
    advantages = torch.where(mask, masked_whiten(centred, mask), 0.0)
    return advantages, advantages


def _broadcast(advantage: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-response advantage ``[B]`` on every valid token, as ``(advantages, returns)``."""
    advantages = torch.where(response_mask.bool(), advantage[:, None], 0.0)
    return advantages, advantages


@register_adv_est("grpo_vectorized")
@torch.no_grad()
def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised GRPO, whose advantage is ``grpo``'s: ``A_i = (s_i - mean_g) / (std_g +
    epsilon)`` (verl 0.9.1 computes its group std with no variance floor, ``eps=0``). meshppo's
    ``grpo`` is vectorised already, so this is the same computation; verl's runs in float32, this
    in the rewards' float dtype, at least float32.

    Args and returns: as ``compute_grpo_outcome_advantage``."""
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=epsilon,
                                          norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo)


@register_adv_est("gdpo")
@torch.no_grad()
def compute_gdpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (group reward-decoupled normalisation, https://arxiv.org/abs/2601.05242), verl's ``gdpo``:
    each reward component is normalised within its group on its own, so that a component of large
    spread cannot drown the others, then the weighted sum is whitened over the batch's tokens::

        A_k,i = (s_k,i - mean_g s_k) / (std_g s_k + epsilon)     per component k (grpo's, std unbiased)
        A_i   = sum_k w_k A_k,i                                  broadcast to the response's valid tokens
        A     = whiten(A) over the valid tokens of the batch     (``masked_whiten``, as verl)

    ``s_k,i`` is the component's score of response ``i`` (verl's ``algorithm.gdpo_reward_keys``,
    entries of the reward function's dict result): the token rewards, KL penalty included, are
    not read when components are given. A group of one has mean 0 and std 1, as in ``grpo``.

    Args:
        reward_components: ``[B, K]`` scores of the ``K`` components; None: the token rewards'
            sums as one component (verl's estimator without components).
        reward_weights: ``K`` weights (verl's ``algorithm.gdpo_reward_weights``); None: 1 each.
        token_level_rewards, response_mask, index, epsilon: as in ``compute_grpo_outcome_advantage``.
        norm_adv_by_std_in_grpo: accepted for the one signature: verl's trainer never passes it to
            gdpo, which always divides by the std.
        values, gamma, lam, reward_baselines, old_log_probs, sum_pi_squared, rollout_is_weights:
            accepted for the one signature.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask.
    """
    dtype = _float_dtype(token_level_rewards.dtype)
    if reward_components is None:
        components = _outcome_scores(token_level_rewards)[:, None]
    else:
        components = torch.as_tensor(reward_components, device=token_level_rewards.device).to(dtype)
    count = components.shape[1]
    if components.shape[0] != response_mask.shape[0]:
        raise ValueError(f"reward_components must hold one row per response: {components.shape[0]} rows for "
                         f"{response_mask.shape[0]} responses")
    weights = [1.0] * count if reward_weights is None else list(reward_weights)
    if len(weights) != count:
        raise ValueError(f"{len(weights)} reward_weights for {count} reward components (algorithm.gdpo_reward_keys)")
    group, num_groups = _group_ids(index, components.shape[0], components.device)
    _, mean, std = _group_mean_std(components, group, num_groups)  # each component's, per row: [B, K]
    combined = ((components - mean) / (std + epsilon)) @ torch.tensor(weights, dtype=dtype, device=components.device)
    mask = response_mask.bool()
    advantages = torch.where(mask, masked_whiten(combined[:, None].expand(mask.shape), mask), 0.0)
    return advantages, advantages


@register_adv_est("rloo_vectorized")
@torch.no_grad()
def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's vectorised RLOO: ``rloo``'s leave-one-out advantage, except that a group of one
    gets 0 (``rloo`` keeps its raw score).

    Args and returns: as ``compute_rloo_outcome_advantage``."""
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    counts = _group_sums(torch.ones_like(scores), group, num_groups)[group]
    group_totals = _group_sums(scores, group, num_groups)[group]
    leave_one_out = scores - (group_totals - scores) / (counts - 1).clamp(min=1)
    return _broadcast(torch.where(counts > 1, leave_one_out, 0.0), response_mask)


@register_adv_est("grpo_passk")
@torch.no_grad()
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training's outcome advantage (Chen et al. 2025, https://arxiv.org/abs/2503.19595),
    as verl's ``grpo_passk``: in each group only the best response learns, with
    ``A = s_max - s_second`` (the largest score minus the next one, which may equal it), divided
    by ``std_g + epsilon`` (unbiased) when ``norm_adv_by_std_in_grpo``; every other response
    gets 0. Where the best score is tied the gap is 0, so which of the tied responses is taken
    (here the first in the batch) changes nothing.

    Args and returns: as ``compute_grpo_outcome_advantage``.

    Raises:
        ValueError: a group with fewer than 2 responses."""
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    counts = _group_sums(torch.ones_like(scores), group, num_groups)
    if bool((counts < 2).any()):
        raise ValueError(f"grpo_passk needs at least 2 responses per group; a group has {int(counts.min())}")
    _, _, std = _group_mean_std(scores, group, num_groups)
    rows = torch.arange(scores.shape[0], device=scores.device)
    # order by (group, score descending, row): each group's best, then its runner-up, come first
    order = np.lexsort((rows.cpu().numpy(), -scores.double().cpu().numpy(), group.cpu().numpy()))
    order = torch.as_tensor(order, device=scores.device)
    starts = torch.cumsum(counts.long(), 0) - counts.long()
    best, second = order[starts], order[starts + 1]
    gap = scores[best] - scores[second]
    if norm_adv_by_std_in_grpo:
        gap = gap / (std[best] + epsilon)
    advantage = torch.zeros_like(scores).index_copy_(0, best, gap)
    return _broadcast(advantage, response_mask)


@register_adv_est("opo")
@torch.no_grad()
def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with the optimal reward baseline (Hao et al. 2025, https://arxiv.org/abs/2505.23585),
    as verl's ``opo``: ``A_i = s_i - b_g`` with the length-weighted group baseline
    ``b_g = sum_j L_j s_j / sum_j L_j`` (``L_j``: response ``j``'s tokens in ``response_mask``);
    a group of one has ``b = 0``. A group whose responses are all empty (no token to weigh)
    gets ``b = 0`` too, where verl divides 0 by 0; its advantages reach no token either way.

    Args:
        token_level_rewards, response_mask, index: as in ``compute_grpo_outcome_advantage``.
        epsilon, norm_adv_by_std_in_grpo, values, gamma, lam: accepted for the one signature.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask."""
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    lengths = response_mask.to(scores.dtype).sum(-1)
    counts = _group_sums(torch.ones_like(scores), group, num_groups)[group]
    weighted = _group_sums(lengths * scores, group, num_groups)[group]
    total_length = _group_sums(lengths, group, num_groups)[group]
    baseline = torch.where((counts > 1) & (total_length > 0), weighted / total_length.clamp(min=1), 0.0)
    return _broadcast(scores - baseline, response_mask)


@register_adv_est("gpg")
@torch.no_grad()
def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    epsilon: float = 1e-6,
    *,
    norm_adv_by_std_in_grpo: bool = True,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    reward_baselines: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient's advantage (Chu et al. 2025, https://arxiv.org/abs/2504.02546), as
    verl's ``gpg``: ``A_i = alpha (s_i - mean_g)`` with ``alpha = B / max(#{i: s_i != 0}, 1)``
    over the whole batch of ``B`` responses (it raises the weight of a batch where few responses
    score), and mean 0 for a group of one. No std normalisation (verl's ``f_norm`` is 1).

    Args:
        token_level_rewards, response_mask, index: as in ``compute_grpo_outcome_advantage``.
        epsilon, norm_adv_by_std_in_grpo, values, gamma, lam: accepted for the one signature.

    Returns:
        ``(advantages, returns)``, both the same ``[B, T]`` tensor, zero outside the mask."""
    scores = _outcome_scores(token_level_rewards)
    group, num_groups = _group_ids(index, scores.shape[0], scores.device)
    _, mean, _ = _group_mean_std(scores, group, num_groups)
    alpha = scores.shape[0] / (scores != 0).sum().clamp(min=1).to(scores.dtype)
    return _broadcast(alpha * (scores - mean), response_mask)


@register_adv_est("remax")
@torch.no_grad()
def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None,
    *,
    values: torch.Tensor | None = None,
    index: GroupIndex | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, https://arxiv.org/abs/2310.10505), as verl's ``remax``: the
    undiscounted return-to-go minus the score of the prompt's greedy response,
    ``A_t = G_t - b`` with ``G_t = sum_{t' >= t} r_t' m_t'`` (every reward in the mask, however far;
    with KL in the reward the per-token penalties make ``G_t`` vary along the response) and ``b``
    the greedy response's score (no KL); the returns are ``G``. No whitening.

    Args:
        token_level_rewards: ``[B, T]``.
        response_mask: ``[B, T]`` binary.
        reward_baselines: ``[B]``, each row's prompt's greedy score (the trainer generates and
            scores one greedy response per prompt).
        values, index, gamma, lam, norm_adv_by_std_in_grpo: accepted for the one signature.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, zero outside the mask."""
    if reward_baselines is None:
        raise ValueError("the remax advantage estimator needs reward_baselines: the greedy responses' scores")
    dtype = _float_dtype(token_level_rewards.dtype)
    mask = response_mask.to(dtype)
    returns = cumsum((token_level_rewards.to(dtype) * mask).flip(-1), -1).flip(-1) * mask
    advantages = returns - reward_baselines.to(dtype)[:, None] * mask
    return advantages, returns


def _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared, rollout_is_weights, name):
    """The returns-to-go ``G_t`` and the cumulative path-variance proxy ``W_t = sum_{j <= t} w_j m_j``,
    ``w_j = (1 - 2 pi_j + sum pi^2_j) rho_j^2`` (``rho`` the rollout importance weight, 1 without
    one), ``[B, T]`` float64 over the columns, zero after each row's last valid token (``G``) or
    constant there (``W``)."""
    if old_log_probs is None or sum_pi_squared is None:
        raise ValueError(f"the {name} advantage estimator needs old_log_probs and sum_pi_squared: set "
                         "actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    mask = response_mask.bool()
    w = 1 - 2 * old_log_probs.double().exp() + sum_pi_squared.double()
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.double() ** 2
    returns = cumsum(torch.where(mask, token_level_rewards.double(), 0.0).flip(-1), -1).flip(-1)
    return returns, cumsum(torch.where(mask, w, 0.0), -1)


def _otb_baselines(returns, w_cum, mask, members, group, num_groups, handle_zero_tail: bool, epsilon: float):
    """``B_t = sum_i G_it W_it m_it / (sum_i W_it m_it + epsilon)`` over each group's ``members``
    (``[B]`` bool) at each column ``t``; 0 in a group of fewer than two members. With
    ``handle_zero_tail``, a group's single longest member (by valid tokens) gets ``B = 0`` from
    the column of the second-longest member's length on, where no other member has a token."""
    m = (mask & members[:, None]).double()
    num = _group_sums(returns * w_cum * m, group, num_groups)
    den = _group_sums(w_cum * m, group, num_groups) + epsilon
    counts = _group_sums(members.double(), group, num_groups)[group]
    baselines = torch.where((counts > 1)[:, None], (num / den)[group], 0.0)
    if handle_zero_tail:
        lengths = torch.where(members, mask.sum(-1), -1)
        none = torch.full((num_groups,), -1, dtype=lengths.dtype, device=lengths.device)
        longest = none.scatter_reduce(0, group, lengths, "amax")[group]
        at_max = members & (lengths == longest)
        second = none.scatter_reduce(0, group, torch.where(at_max, -1, lengths), "amax")[group]
        lone = at_max & (_group_sums(at_max.double(), group, num_groups)[group] == 1) & (counts > 1)
        cols = torch.arange(mask.shape[1], device=mask.device)
        baselines = torch.where(lone[:, None] & (cols[None, :] >= second[:, None]), 0.0, baselines)
    return baselines


@register_adv_est("optimal_token_baseline")
@torch.no_grad()
def compute_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The optimal token baseline, as verl's ``optimal_token_baseline``: a baseline per prompt
    group and timestep (column) ``t`` that weighs each response's return by how much score-function
    variance its path has gathered so far,

        A_t = G_t - B_t,   B_t = sum_i G_it W_it / sum_i W_it   (over the group, valid tokens)

    with ``G_t`` the undiscounted return-to-go and ``W_t = sum_{j <= t} ||s_j||^2`` the cumulative
    proxy ``||s_j||^2 = 1 - 2 pi_j(y_j) + sum_v pi_j(v)^2`` of the squared norm of the token's
    score (``pi_j(y_j) = exp(old_log_probs)``, the sum from the actor's old-log-prob pass), each
    term times ``rollout_is_weights^2`` when rollout importance weights are given. A group of one
    response has ``B = 0``. The returns are ``G``.

    Args:
        token_level_rewards, response_mask, index: as in ``compute_grpo_outcome_advantage``.
        old_log_probs: ``[B, T]``, the actor's log-prob of each sampled token before the update.
        sum_pi_squared: ``[B, T]``, sum over the vocabulary of the squared probabilities of the
            distribution each token was scored under (``actor.calculate_sum_pi_squared``).
        rollout_is_weights: ``[B, T]`` truncated importance weights pi_old / pi_rollout, or None.
        handle_zero_tail: zero the baseline of a group's single longest response past the
            second-longest one's length, where it alone has tokens (on by default, as verl's,
            which its trainer never changes).
        epsilon: added to the baseline's denominator.
        values, gamma, lam, norm_adv_by_std_in_grpo, reward_baselines: accepted for the one signature.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, zero outside the mask (verl leaves the returns
        non-zero at masked positions inside a response; nothing reads them there)."""
    dtype = _float_dtype(token_level_rewards.dtype)
    mask = response_mask.bool()
    returns, w_cum = _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                 rollout_is_weights, "optimal_token_baseline")
    group, num_groups = _group_ids(index, mask.shape[0], mask.device)
    members = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
    baselines = _otb_baselines(returns, w_cum, mask, members, group, num_groups, handle_zero_tail, epsilon)
    return (torch.where(mask, returns - baselines, 0.0).to(dtype), torch.where(mask, returns, 0.0).to(dtype))


@register_adv_est("tir_optimal_token_baseline")
@torch.no_grad()
def compute_multi_turn_optimal_token_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: GroupIndex,
    old_log_probs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``tir_optimal_token_baseline`` (tool-integrated reasoning): the optimal token
    baseline of ``compute_optimal_token_baseline_advantage`` with the timestep of a token its
    index among its response's valid tokens rather than its column, so that tokens outside the
    mask inside a response (a multi-turn rollout's observations; here the tokens rollout
    rejection removed) do not shift the later ones against the other responses of the group.
    Responses without a valid token take no part in their group (a group with one other
    response is a group of one: ``B = 0``). Where every response's mask is a prefix of its
    columns and none is empty, both estimators agree.

    Args: as ``compute_optimal_token_baseline_advantage``.

    Returns:
        ``(advantages, returns)``, ``[B, T]``, zero outside the mask."""
    dtype = _float_dtype(token_level_rewards.dtype)
    mask = response_mask.bool()
    returns, w_cum = _otb_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared,
                                 rollout_is_weights, "tir_optimal_token_baseline")
    group, num_groups = _group_ids(index, mask.shape[0], mask.device)
    slots = _valid_slots(mask)
    compact = _compact_valid(mask.double(), mask, slots).bool()
    returns_c = _compact_valid(returns, mask, slots)
    baselines = _otb_baselines(returns_c, _compact_valid(w_cum, mask, slots), compact, compact.any(-1), group,
                               num_groups, handle_zero_tail, epsilon)
    advantages = _expand_valid(returns_c - baselines, mask, slots)
    return advantages.to(dtype), torch.where(mask, returns, 0.0).to(dtype)


def get_adv_estimator_fn(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The advantage estimator registered under ``name`` (``algorithm.adv_estimator``)."""
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"Unknown advantage estimator {name!r}; valid names are {list(ADV_ESTIMATORS)}.")
    return ADV_ESTIMATORS[name]


LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""Valid ``loss_agg_mode`` values (``actor_rollout_ref.actor.loss_agg_mode``)."""


def compute_pf_ppo_indices(scores: torch.Tensor, reweight_method: str, weight_pow: float,
                           generator: torch.Generator | None = None) -> torch.Tensor:
    """PF-PPO's redraw of a batch (policy filtration, verl's `compute_pf_ppo_reweight_data`): `[N]`
    row indices drawn with replacement, row i with probability proportional to its weight from its
    sequence score `scores[i]`: `pow` |s|^weight_pow (|0|^0 = 1); `max_min` 1 where s is the batch's
    highest or lowest score, else 0; `max_random` 0.4 for the highest, 0.1 otherwise. Every weight gets
    1e-8, so a batch of zero weights (all scores 0 under pow) draws uniformly, as verl's does. Drawn on
    the host, in float64, from `generator` (the same indices on every rank given the same seed).

    The pow weights are formed relative to the largest one, in log space: w_i / w_max =
    exp(p (log|s_i| - log|s_max|)) and the 1e-8 as exp(log 1e-8 - p log|s_max|), so a power that
    overflows |s|^p (2.5^1000) still draws, where verl's weights become inf and torch.multinomial
    fails; the weights are the same up to a common factor, so the draw is verl's where verl's draws."""
    s = scores.detach().double().cpu()
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"PF-PPO needs finite sequence scores to weigh; got {s[~torch.isfinite(s)][:4].tolist()}")
    if reweight_method == "pow":
        if not (math.isfinite(weight_pow) and weight_pow >= 0):
            raise ValueError(f"algorithm.pf_ppo.weight_pow must be a finite number >= 0, got {weight_pow}")
        log_abs = s.abs().log()  # -inf for a score of 0
        top = float(log_abs.max())
        # log(w_i / w_max) <= 0; 0 for the rows of the largest |s| (every row when all scores are 0, or p = 0)
        rel = torch.where(log_abs == top, 0.0, weight_pow * (log_abs - top)) if weight_pow > 0 else torch.zeros_like(s)
        log_max = weight_pow * top if weight_pow > 0 else 0.0  # log w_max (-inf: every score 0)
        log_floor = math.log(1e-8) - log_max  # the 1e-8 relative to w_max: log(1e-8 / w_max)
        # (w_i + 1e-8) / w_max, or / 1e-8 where that is larger (w_max < 1e-8; +inf: every weight 0, a uniform draw)
        weights = rel.exp() + math.exp(log_floor) if log_floor < 0 else (rel - log_floor).exp() + 1.0
    elif reweight_method == "max_min":
        weights = ((s == s.max()) | (s == s.min())).double() + 1e-8
    elif reweight_method == "max_random":
        weights = torch.where(s == s.max(), 0.4, 0.1).double() + 1e-8
    else:
        raise ValueError(f"unknown PF-PPO reweight_method {reweight_method!r}; use pow, max_min or max_random")
    return torch.multinomial(weights, len(s), replacement=True, generator=generator)


def _check_loss_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss_agg_mode {loss_agg_mode!r}; valid modes are {list(LOSS_AGG_MODES)}.")


def count_loss_units(response_mask: torch.Tensor | np.ndarray, loss_agg_mode: str) -> float:
    """How many units ``agg_loss`` averages over in this (micro-)batch.

    Tokens for ``token-mean`` (and ``token-sum``, which sums them without averaging); non-empty
    sequences (rows with at least one valid token) for the ``seq-mean-*`` modes. The trainer
    sums this over the micro-batches of a mini-batch and all-reduces the sum over the
    data-parallel group to get ``global_num_tokens`` / ``global_num_seqs``. Reads the count on the host, before the forward, so it does not
    stall a running kernel queue; ``response_mask`` may be a NumPy array (the trainer's
    planning counts without torch CPU ops, whose thread pool can stall on a busy host).
    """
    _check_loss_agg_mode(loss_agg_mode)
    mask = response_mask != 0
    if loss_agg_mode in ("token-mean", "token-sum"):
        return float(mask.sum())
    return float((mask.sum(-1) > 0).sum())


def _divide(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    # A zero count only happens when there is nothing to average, where total is 0 too;
    # dividing by 1 then gives 0 instead of NaN.
    if isinstance(count, torch.Tensor):
        count = count.to(device=total.device, dtype=total.dtype)
        return total / torch.where(count > 0, count, torch.ones_like(count))
    return total / (count if count > 0 else 1.0)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    global_num_tokens: torch.Tensor | float | None = None,
    global_num_seqs: torch.Tensor | float | None = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix to the scalar to back-propagate.

    Modes (``L_{i,t}`` the loss, ``m_{i,t}`` the mask, ``n_i = sum_t m_{i,t}``):

    - ``token-mean``: ``sum_{i,t} m L / N_tokens`` -- every token weighs the same (DAPO).
    - ``token-sum``: ``sum_{i,t} m L`` -- no average: the loss grows with the batch's tokens.
    - ``seq-mean-token-sum``: ``sum_i (sum_t m L) / N_seqs``.
    - ``seq-mean-token-mean``: ``sum_i (sum_t m L / n_i) / N_seqs`` -- every sequence weighs
      the same (the original GRPO).
    - ``seq-mean-token-sum-norm``: ``sum_i (sum_t m L / T_max) / N_seqs`` with
      ``T_max = loss_scale_factor`` or else ``loss_mask.shape[-1]`` (Dr. GRPO's constant
      normaliser).

    ``N_seqs`` counts non-empty rows only: a padding row (all-zero mask) contributes nothing
    and is not counted. verl's engine workers leave empty rows out of the sum too, but divide
    by the mini-batch's rows, empty ones included (``global_batch_size``): the same where no
    response is empty (an empty response weighs the others less there). The trainer passes
    ``global_num_seqs`` counted from the response mask, before rollout rejection, so a row
    that rejection emptied counts, as in verl.

    Normalisation contract. Without global counts, ``N_tokens`` / ``N_seqs`` are this
    call's own counts: the plain local mean. With ``global_num_tokens`` (token-mean) or
    ``global_num_seqs`` (seq-mean modes) -- the counts over the whole mini-batch, summed
    over micro-batches *and* data-parallel ranks (``count_loss_units`` + all-reduce) --
    the result is ``sum(local terms) / global_count * dp_size``. Then summing the returned
    losses over a rank's micro-batches (no division by the number of micro-batches) and
    averaging gradients over ``dp_size`` ranks (FSDP's reduce-scatter) yields exactly the
    gradient of the global mean, as in verl's engine workers. ``token-sum`` reads no count: it
    returns ``sum(local terms) * dp_size``, whose averaged gradient is that of the global sum.

    For ``seq-mean-token-sum-norm`` with dynamic micro-batches, pass a constant
    ``loss_scale_factor`` (e.g. the configured response length): ``loss_mask.shape[-1]``
    varies with each micro-batch's padding, and so would the gradient's weight.

    Args:
        loss_mat: ``[B, T]`` per-token loss.
        loss_mask: ``[B, T]`` binary.
        loss_agg_mode: one of ``LOSS_AGG_MODES``.
        global_num_tokens: mini-batch token count over all micro-batches and ranks.
        global_num_seqs: mini-batch non-empty sequence count over all micro-batches and ranks.
        dp_size: number of data-parallel ranks whose gradients are averaged.
        loss_scale_factor: constant ``T_max`` for ``seq-mean-token-sum-norm``.

    Returns:
        A scalar tensor.
    """
    _check_loss_agg_mode(loss_agg_mode)
    mask = loss_mask.bool()
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, mask) * dp_size
    if loss_agg_mode == "token-mean":
        total = masked_sum(loss_mat, mask)
        global_count, other, unit = global_num_tokens, global_num_seqs, "global_num_tokens"
        local_count = mask.sum()
    else:
        token_sums = masked_sum(loss_mat, mask, axis=-1)
        lengths = mask.sum(dim=-1)
        if loss_agg_mode == "seq-mean-token-sum":
            seq_losses = token_sums
        elif loss_agg_mode == "seq-mean-token-mean":
            seq_losses = token_sums / torch.where(lengths > 0, lengths, 1).to(token_sums.dtype)
        else:
            seq_losses = token_sums / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])
        total = seq_losses.sum()
        global_count, other, unit = global_num_seqs, global_num_tokens, "global_num_seqs"
        local_count = (lengths > 0).sum()

    if global_count is None:
        if other is not None:
            raise ValueError(f"loss_agg_mode={loss_agg_mode!r} normalises by {unit}, which was not given.")
        if dp_size != 1:
            raise ValueError(f"dp_size={dp_size} only applies with global normalisation; pass {unit} too.")
        return _divide(total, local_count)
    return _divide(total, global_count) * dp_size


class PolicyLossOutput(NamedTuple):
    """What every policy loss returns: the scalar loss (carries gradient) and detached local
    statistics over the valid tokens, each with the meaning verl gives it for that loss (the
    losses' docstrings say which; 0 where verl's loss reports none)."""

    pg_loss: torch.Tensor
    pg_clipfrac: torch.Tensor          # fraction of tokens where the ratio clip is active
    ppo_kl: torch.Tensor               # mean of old - new log-prob: an estimate of KL(old || new)
    pg_clipfrac_lower: torch.Tensor    # fraction of tokens where the dual clip is active


class PolicyLossParams(NamedTuple):
    """The parameters that only some policy losses read, with verl's defaults: its
    ``actor.policy_loss.*`` (clip_cov, kl_cov, dro) and ``actor.tau_pos`` / ``tau_neg`` (sapo)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float | None = None  # no default: dro needs one


POLICY_LOSS_INPUTS: tuple[str, ...] = (
    "old_log_prob", "log_prob", "advantages", "response_mask", "cliprange", "cliprange_low", "cliprange_high",
    "clip_ratio_c", "loss_agg_mode", "rollout_is_weights", "loss_params", "generator",
)
"""The keywords every policy loss accepts, besides ``agg_loss``'s normalisation options; each
reads the ones its formula needs and says which it only accepts."""

POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {}
"""Policy losses by ``actor.policy_loss.loss_mode`` (verl's names), filled by ``register_policy_loss``."""

BYPASS_LOSS_TYPES: dict[str, str] = {"ppo_clip": "vanilla", "reinforce": "gpg"}
"""``algorithm.rollout_correction.loss_type`` -> the entry of ``POLICY_LOSSES`` that bypass mode
trains with. verl's bypass mode replaces ``loss_mode`` by its own loss, which runs PPO's clip
(``vanilla``) or its ``compute_policy_loss_reinforce``, the formula of ``gpg``."""


def register_policy_loss(name: str) -> Callable:
    """Register a policy loss under ``name``; it takes the keywords of ``POLICY_LOSS_INPUTS``
    (plus ``**agg_kwargs`` for ``agg_loss``) and returns a ``PolicyLossOutput``."""
    return _registrar(POLICY_LOSSES, POLICY_LOSS_INPUTS, "policy loss", name)


def _clip_range(cliprange: float | None, cliprange_low: float | None, cliprange_high: float | None,
                loss: str) -> tuple[float, float]:
    """``(low, high)``: each side defaults to ``cliprange``."""
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    if low is None or high is None:
        raise ValueError(f"{loss} needs cliprange, or both cliprange_low and cliprange_high.")
    return low, high


def _token_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_prob - old_log_prob, its exp)``; the exp of the log-ratio clamped to ``[-20, 20]``."""
    log_ratio = log_prob - old_log_prob
    return log_ratio, torch.exp(torch.clamp(log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND))


def _weighted(pg_losses: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    return pg_losses if rollout_is_weights is None else pg_losses * rollout_is_weights


def _fraction(flags: torch.Tensor, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return masked_mean(flags.to(like.dtype), mask)


@register_policy_loss("vanilla")
def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """PPO's clipped surrogate loss with asymmetric and dual clipping (verl's ``vanilla``).

    With ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and advantage ``A``::

        L_clip = max(-A * r, -A * clip(r, 1 - cliprange_low, 1 + cliprange_high))   # Schulman et al. 2017
        L      = min(L_clip, -A * clip_ratio_c)   if A < 0   else L_clip          # dual-clip, Ye et al. 2020

    The asymmetric range is DAPO's "clip-higher" (https://arxiv.org/abs/2503.14476). The
    dual clip (https://arxiv.org/abs/1912.09729) bounds the loss of a token with negative
    advantage whose ratio has grown large, where plain PPO's ``max`` would follow ``-A r``
    without bound; on that branch the token carries no gradient. The ``[-20, 20]`` clamp
    keeps ``exp`` finite when the two policies disagree wildly.

    With ``rollout_is_weights`` (rollout correction, ``compute_rollout_correction``) each
    token's ``L`` is multiplied by its detached weight before aggregation. Rollout rejection is
    not a weight: the caller passes the response mask without the rejected tokens.

    Args:
        old_log_prob: ``[B, T]`` log-probs under the rollout (behaviour) policy.
        log_prob: ``[B, T]`` log-probs under the policy being trained (carries gradient).
        advantages: ``[B, T]``.
        response_mask: ``[B, T]`` binary.
        cliprange: epsilon of PPO (``actor.clip_ratio``).
        cliprange_low, cliprange_high: the two sides of the ratio clip; default ``cliprange``.
        clip_ratio_c: dual-clip bound, > 1.
        loss_agg_mode: see ``agg_loss``.
        rollout_is_weights: ``[B, T]`` detached per-token weights, or None.
        loss_params, generator: accepted for the one signature (``POLICY_LOSS_INPUTS``).
        **agg_kwargs: forwarded to ``agg_loss`` (``global_num_tokens``, ``global_num_seqs``,
            ``dp_size``, ``loss_scale_factor``).

    Returns:
        ``PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)``: the scalar loss,
        the fraction of valid tokens where the ratio clip is active, the mean of ``old - new``
        log-prob (an estimate of KL(old || new)), and the fraction where the dual clip is
        active. The three statistics are detached local masked means.
    """
    cliprange_low, cliprange_high = _clip_range(cliprange, cliprange_low, cliprange_high, "compute_policy_loss")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (the dual-clip bound) must be > 1.0, got {clip_ratio_c}")

    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    negative = advantages < 0
    pg_losses = _weighted(torch.where(negative, clip_pg_losses2, clip_pg_losses1), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)

    with torch.no_grad():
        pg_clipfrac = _fraction(pg_losses2 > pg_losses1, response_mask, pg_losses)
        pg_clipfrac_lower = _fraction((clip_pg_losses1 > pg_losses3) & negative, response_mask, pg_losses)
        # verl's: of the log-ratio clamped as the ratio is
        ppo_kl = masked_mean(-torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), response_mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


def _dppo_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_c, loss_agg_mode, rollout_is_weights,
               inside: torch.Tensor, agg_kwargs: dict) -> PolicyLossOutput:
    """What the two DPPO losses share, given each token's ``inside`` (its probability has not yet
    moved past the divergence bound in its advantage's direction)::

        L = -A * sg[min(r, clip_ratio_c)] * log_prob * inside

    with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``: the plain policy gradient, weighed by
    the truncated ratio (truncated importance sampling instead of a dual clip), and no gradient
    for a token outside. ``pg_clipfrac`` is the fraction of valid tokens outside,
    ``pg_clipfrac_lower`` that of tokens inside whose ratio is truncated (verl's)."""
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    inside = inside.detach().to(log_prob.dtype)
    truncated = torch.clamp(ratio, max=clip_ratio_c).detach()
    pg_losses = _weighted(-advantages * truncated * log_prob * inside, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = masked_mean(1.0 - inside, response_mask)
        pg_clipfrac_lower = masked_mean((ratio > clip_ratio_c).to(inside.dtype) * inside, response_mask)
        ppo_kl = masked_mean(-torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), response_mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dppo_tv")
def compute_policy_loss_dppo_tv(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """DPPO-Binary-TV (divergence PPO, https://arxiv.org/abs/2602.04879), verl's ``dppo_tv``: the
    trust region bounds the change of the sampled token's probability ``p = exp(log_prob)`` from
    ``p_old = exp(old_log_prob)`` (a total-variation bound) instead of the ratio. A token stays in
    while ``p - p_old <= cliprange_high`` (``A > 0``) or ``p - p_old >= -cliprange_low`` (``A <= 0``),
    and then its loss is ``_dppo_loss``'s.

    Args:
        cliprange, cliprange_low, cliprange_high: the bounds of ``p - p_old`` (``actor.clip_ratio*``:
            probability differences here, not ratios).
        clip_ratio_c: the truncation of the detached ratio (``actor.clip_ratio_c``).
        loss_params, generator: accepted for the one signature.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``pg_clipfrac`` the fraction of valid tokens out of bounds,
        ``pg_clipfrac_lower`` that of tokens in bounds with a truncated ratio, ``ppo_kl`` the
        mean of the clamped ``old - new`` log-prob.
    """
    low, high = _clip_range(cliprange, cliprange_low, cliprange_high, "compute_policy_loss_dppo_tv")
    change = log_prob.exp() - old_log_prob.exp()
    inside = torch.where(advantages > 0, change <= high, change >= -low)
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_c, loss_agg_mode,
                      rollout_is_weights, inside, agg_kwargs)


DPPO_KL_EPSILON = 1e-8
"""Added to both sides of the binary KL's ``(1 - p_old) / (1 - p)`` (verl's), finite at ``p = 1``."""


@register_policy_loss("dppo_kl")
def compute_policy_loss_dppo_kl(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """DPPO-Binary-KL (https://arxiv.org/abs/2602.04879), verl's ``dppo_kl``: as ``dppo_tv`` with
    the KL of the two Bernoulli distributions "this token or another" as the divergence,

        D = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))

    A token with ``A > 0`` stays in while ``D <= cliprange_high`` or its probability has not grown
    (``p <= p_old``); one with ``A <= 0`` while ``D <= cliprange_low`` or ``p >= p_old``.

    Args and returns: as ``compute_policy_loss_dppo_tv``, the bounds on ``D``.
    """
    low, high = _clip_range(cliprange, cliprange_low, cliprange_high, "compute_policy_loss_dppo_kl")
    p, p_old = log_prob.exp(), old_log_prob.exp()
    divergence = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log(
        (1.0 - p_old + DPPO_KL_EPSILON) / (1.0 - p + DPPO_KL_EPSILON))
    inside = torch.where(advantages > 0, (divergence <= high) | (p <= p_old), (divergence <= low) | (p >= p_old))
    return _dppo_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio_c, loss_agg_mode,
                      rollout_is_weights, inside, agg_kwargs)


GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's per-token log-ratio is clamped from above at 10 before ``exp`` (verl's bound)."""


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Group Sequence Policy Optimization (Zheng et al. 2025, https://arxiv.org/abs/2507.18071):
    PPO's clip on a sequence-level ratio.

    The sequence ratio is the geometric mean of its token ratios,
    ``s_i = exp(mean_t (log_prob - old_log_prob))`` over the sequence's valid tokens. Each token
    carries ``s_i,t = sg[s_i] * pi_t / sg[pi_t]`` (``sg``: stop-gradient), whose value is ``s_i``
    and whose gradient is ``s_i * grad log pi_t``, so that with a sequence-level advantage the
    gradient of the aggregated loss is that of ``-A_i s_i``::

        log s_i,t = min(log_prob - sg[log_prob] + sg[log s_i], 10)
        L_i,t     = max(-A * s_i,t, -A * clip(s_i,t, 1 - cliprange_low, 1 + cliprange_high))

    aggregated by ``loss_agg_mode``, as verl does (its trainer passes the actor's, token-mean by
    default; the paper's aggregation, every sequence weighing the same, is ``seq-mean-token-mean``,
    this function's default as verl's). GSPO's clip range is tiny (verl's recipes: 3e-4 / 4e-4).
    The sequence ratio needs whole sequences in the micro-batch, which meshppo's micro-batches
    always hold.

    Args:
        cliprange, cliprange_low, cliprange_high: the clip of ``s``, as in ``compute_policy_loss``.
        loss_agg_mode: see ``agg_loss``.
        clip_ratio_c, loss_params, generator: accepted for the one signature.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``pg_clipfrac`` the fraction of valid tokens whose sequence ratio
        is clipped, ``ppo_kl`` the token-level mean of ``old - new`` log-prob,
        ``pg_clipfrac_lower`` 0 (no dual clip).
    """
    cliprange_low, cliprange_high = _clip_range(cliprange, cliprange_low, cliprange_high, "compute_policy_loss_gspo")
    mask = response_mask.bool()
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, mask, axis=-1)
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=GSPO_LOG_RATIO_MAX))
    pg_losses1 = -advantages * seq_ratio
    pg_losses2 = -advantages * torch.clamp(seq_ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    pg_losses = _weighted(torch.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = _fraction(pg_losses2 > pg_losses1, mask, pg_losses)
        ppo_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl))


@register_policy_loss("sapo")
def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "seq-mean-token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Soft Adaptive Policy Optimization (https://arxiv.org/abs/2511.20347): a smooth gate on the
    token ratio instead of a clip.

    With ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` and ``tau = tau_pos`` where
    ``A > 0``, ``tau_neg`` elsewhere (``loss_params``)::

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau        L = -f(r) * A

    ``f(1) = 2 / tau`` and ``f'(1) = 1``: on-policy the gradient is PPO's; away from ``r = 1``
    it fades smoothly rather than stopping at a clip boundary. Aggregated
    ``seq-mean-token-mean`` whatever ``loss_agg_mode``, as verl.

    Args:
        loss_params: ``tau_pos``, ``tau_neg`` (> 0).
        loss_agg_mode: not read: the aggregation is ``seq-mean-token-mean``.
        cliprange, cliprange_low, cliprange_high, clip_ratio_c, generator: accepted for the one
            signature; nothing is clipped.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput`` with both clip fractions 0 and ``ppo_kl`` the mean of the clamped
        ``old - new`` log-prob.
    """
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    tau = torch.where(advantages > 0, ratio.new_tensor(loss_params.tau_pos), ratio.new_tensor(loss_params.tau_neg))
    gates = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = _weighted(-gates * advantages, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, "seq-mean-token-mean", **agg_kwargs)
    with torch.no_grad():
        ppo_kl = masked_mean(-torch.clamp(log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND), response_mask)
        zero = torch.zeros_like(ppo_kl)
    return PolicyLossOutput(pg_loss, zero, ppo_kl, zero)


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """The plain policy gradient (REINFORCE, Williams 1992; GPG, https://github.com/AMAP-ML/GPG)
    with optional importance weights: verl's ``gpg``, and bypass mode's
    ``rollout_correction.loss_type=reinforce`` (verl's ``compute_policy_loss_reinforce``)::

        L = -w * A * log_prob        w = rollout_is_weights (detached), 1 without them

    Its gradient ``-w A grad log pi`` is the policy gradient for tokens sampled from the policy
    whose log-probs are ``old_log_prob`` (the engine's, in bypass mode), corrected by ``w``.
    There is no ratio and no clip: the truncation of ``w`` and rejection are the only bounds.

    Args:
        old_log_prob: ``[B, T]`` log-probs of the sampling policy (only for ``ppo_kl``).
        log_prob, advantages, response_mask, loss_agg_mode, rollout_is_weights, **agg_kwargs:
            as in ``compute_policy_loss``.
        cliprange, cliprange_low, cliprange_high, clip_ratio_c, loss_params, generator: accepted
            for the one signature; nothing is clipped.

    Returns:
        ``PolicyLossOutput`` with both clip fractions 0 (verl's ``gpg`` reports no statistic;
        its ``reinforce`` reports this ``ppo_kl``).
    """
    pg_losses = _weighted(-advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        ppo_kl = masked_mean(old_log_prob - log_prob, response_mask)
        zero = torch.zeros_like(ppo_kl)
    return PolicyLossOutput(pg_loss, zero, ppo_kl, zero)


def _centred_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(A - mean A) * (log_prob - mean log_prob)`` per token, the means over this call's valid
    tokens (detached): each token's term of the covariance of advantage and log-prob."""
    log_prob = log_prob.detach()
    return (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))


def _share(ratio: float, mask: torch.Tensor) -> torch.Tensor:
    """``max(floor(ratio * n), 1)`` for ``n`` valid tokens, as a device scalar (no host sync)."""
    n = mask.sum(dtype=torch.float64)
    return torch.clamp(torch.floor(ratio * n), min=1.0)


def _first_by_key(keys: torch.Tensor, eligible: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Boolean ``[B, T]``: the ``count`` eligible positions of smallest key (all of them when
    fewer), ties to the earlier position in row-major order. One stable sort, no host sync
    (``topk`` would need ``count`` on the host)."""
    flat = torch.where(eligible, keys, math.inf).flatten()
    order = torch.argsort(flat, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return eligible & (rank.view(eligible.shape) < count)


@register_policy_loss("clip_cov")
def compute_policy_loss_clip_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
    Language Models", https://arxiv.org/abs/2505.22617): PPO's clip, and the gradient of a few
    tokens of high advantage x log-prob covariance detached, which slows the entropy collapse.

    With ``r`` and the clip as in ``compute_policy_loss`` (no dual clip) and
    ``C_t = (A_t - mean A) (log_prob_t - mean log_prob)``, the means over this call's valid
    tokens (the micro-batch: a local statistic, as in verl)::

        L_t = max(-A r, -A clip(r, 1 - cliprange_low, 1 + cliprange_high)) * (0 if t is chosen else 1)

    The chosen tokens: ``max(floor(clip_cov_ratio * n_valid), 1)`` of the valid, unclipped tokens
    with ``clip_cov_lb < C_t < clip_cov_ub`` (all of them when fewer), uniformly at random. The
    draw takes one random key per position from ``generator`` (None: torch's default generator,
    as verl's ``randperm``) and keeps the smallest keys, so a seeded generator repeats it.

    Args:
        loss_params: ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``.
        generator: a ``torch.Generator`` on the inputs' device, or None.
        clip_ratio_c: accepted for the one signature.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``pg_clipfrac`` is verl's for this loss, the fraction of valid
        tokens chosen (detached); ``pg_clipfrac_lower`` 0.
    """
    cliprange_low, cliprange_high = _clip_range(cliprange, cliprange_low, cliprange_high,
                                                "compute_policy_loss_clip_cov")
    mask = response_mask.bool()
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    with torch.no_grad():
        cov = _centred_covariance(advantages, log_prob, mask)
        eligible = mask & ~(pg_losses2 > pg_losses1) & (cov > loss_params.clip_cov_lb) & (cov < loss_params.clip_cov_ub)
        keys = torch.rand(mask.shape, generator=generator, device=mask.device, dtype=torch.float64)
        chosen = _first_by_key(keys, eligible, _share(loss_params.clip_cov_ratio, mask))
    pg_losses = torch.where(chosen, 0.0, torch.maximum(pg_losses1, pg_losses2))
    pg_loss = agg_loss(_weighted(pg_losses, rollout_is_weights), mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = _fraction(chosen, mask, pg_losses)
        ppo_kl = masked_mean(-log_ratio, mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl))


@register_policy_loss("kl_cov")
def compute_policy_loss_kl_cov(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """KL-Cov (Cui et al. 2025, https://arxiv.org/abs/2505.22617): the unclipped policy-gradient
    surrogate, plus a penalty on the log-ratio of the tokens of highest advantage x log-prob
    covariance ``C_t`` (as in ``compute_policy_loss_clip_cov``, over this call's valid tokens)::

        L_t = -A r + (ppo_kl_coef * |log_prob - old_log_prob| if t is chosen else 0)

    with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))`` (verl's ``kl_cov`` does not clamp: the
    two differ only where a ratio passes e^20, where verl's loss is e^(log-ratio - 20) times larger).
    The chosen tokens: the
    ``max(floor(kl_cov_ratio * n_valid), 1)`` valid tokens of largest ``C_t`` (verl's top-k),
    ties to the earlier position in row-major order.

    Args:
        loss_params: ``kl_cov_ratio``, ``ppo_kl_coef``.
        cliprange, cliprange_low, cliprange_high, clip_ratio_c, generator: accepted for the one
            signature; nothing is clipped.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``ppo_kl`` is verl's for this loss, the mean of
        ``|log_prob - old_log_prob|``; both clip fractions 0.
    """
    mask = response_mask.bool()
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    with torch.no_grad():
        cov = _centred_covariance(advantages, log_prob, mask)
        chosen = _first_by_key(-cov, mask, _share(loss_params.kl_cov_ratio, mask))
    penalty = torch.where(chosen, loss_params.ppo_kl_coef * log_ratio.abs(), 0.0)
    pg_losses = _weighted(-advantages * ratio + penalty, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        ppo_kl = masked_mean(log_ratio.abs(), mask)
        zero = torch.zeros_like(ppo_kl)
    return PolicyLossOutput(pg_loss, zero, ppo_kl, zero)


@register_policy_loss("geo_mean")
def compute_policy_loss_geo_mean(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Geometric-Mean Policy Optimization (GMPO, Zhao et al. 2025, https://arxiv.org/abs/2507.20673):
    the sequence's geometric mean of token ratios, each clipped in log space, times its mean
    advantage.

    With ``d_t = clamp(log_prob - old_log_prob, -20, 20)``, ``c_t = clip(d_t, -cliprange_low,
    cliprange_high)`` and ``sgn = sign(A_t)``::

        d'_t = sgn * min(sgn * d_t, sgn * c_t)            # PPO's pessimistic side, per token
        L_i  = -mean_t(A) * exp(mean_t d'_t) * w_i        # means over the sequence's valid tokens
        w_i  = exp(mean_t log(rollout_is_weights + 1e-10))  (1 without weights)

    then the mean of ``L_i`` over the non-empty sequences (over the caller's global sequence
    count), whatever ``loss_agg_mode``: verl takes ``torch.mean`` over the micro-batch's rows.
    The formula is meant for sequence-level advantages (GRPO, RLOO); with token-level ones it
    uses their mean. verl does not clamp ``d_t``; the ``[-20, 20]`` clamp keeps ``exp`` finite.

    Args:
        cliprange, cliprange_low, cliprange_high: the log-space clip (``actor.clip_ratio*``).
        loss_agg_mode: not read: the aggregation is the sequence mean.
        clip_ratio_c, loss_params, generator: accepted for the one signature.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``pg_clipfrac`` / ``pg_clipfrac_lower`` the fractions of valid
        tokens whose log-ratio lies outside the clip range with a positive / negative advantage
        (verl's), ``ppo_kl`` the mean of ``old - new`` log-prob.
    """
    cliprange_low, cliprange_high = _clip_range(cliprange, cliprange_low, cliprange_high,
                                                "compute_policy_loss_geo_mean")
    mask = response_mask.bool()
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND)
    clipped = torch.clamp(log_ratio, -cliprange_low, cliprange_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp(masked_mean(pessimistic, mask, axis=-1))
    seq_losses = -masked_mean(advantages, mask, axis=-1) * seq_ratio
    if rollout_is_weights is not None:
        seq_losses = seq_losses * torch.exp(masked_mean(torch.log(rollout_is_weights + 1e-10), mask, axis=-1))
    rows = mask.any(dim=-1, keepdim=True)
    pg_loss = agg_loss(seq_losses[:, None], rows, "seq-mean-token-sum", **agg_kwargs)
    with torch.no_grad():
        outside = log_ratio != clipped
        pg_clipfrac = _fraction(outside & (advantages > 0), mask, seq_losses)
        pg_clipfrac_lower = _fraction(outside & (advantages < 0), mask, seq_losses)
        ppo_kl = masked_mean(old_log_prob - log_prob, mask)  # verl's: of the log-ratio before its clamp
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower)


@register_policy_loss("dro")
def compute_policy_loss_dro(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Direct Reward Optimization as verl's ``dro``: the plain policy gradient with a quadratic
    penalty on the log-ratio instead of a clip::

        L = -(A * log_prob - beta / 2 * (log_prob - old_log_prob)^2)

    (``beta = loss_params.dro_beta``, > 0, verl's ``policy_loss.dro_beta``).

    Args:
        loss_params: ``dro_beta``.
        cliprange, cliprange_low, cliprange_high, clip_ratio_c, generator: accepted for the one
            signature; nothing is clipped.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput`` with both clip fractions 0 (verl's reports none) and ``ppo_kl`` the
        mean of ``old - new`` log-prob.
    """
    beta = loss_params.dro_beta
    if beta is None or not beta > 0:
        raise ValueError(f"the dro policy loss needs dro_beta > 0 (actor.policy_loss.dro_beta), got {beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = _weighted(-(log_prob * advantages - 0.5 * beta * log_ratio.square()), rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        ppo_kl = masked_mean(-log_ratio, response_mask)
        zero = torch.zeros_like(ppo_kl)
    return PolicyLossOutput(pg_loss, zero, ppo_kl, zero)


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float | None = None,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    loss_params: PolicyLossParams = PolicyLossParams(),
    generator: torch.Generator | None = None,
    **agg_kwargs,
) -> PolicyLossOutput:
    """Clipped IS-weight Policy Optimization (CISPO, MiniMax-M1, https://arxiv.org/abs/2506.13585):
    the clipped ratio, detached, weighs the plain policy gradient, so a clipped token still
    carries gradient (PPO's clip drops it)::

        L = -sg[clip(r, 1 - cliprange_low, 1 + cliprange_high)] * A * log_prob

    with ``r = exp(clamp(log_prob - old_log_prob, -20, 20))``.

    Args:
        cliprange, cliprange_low, cliprange_high: the clip of the weight.
        clip_ratio_c, loss_params, generator: accepted for the one signature.
        the others: as in ``compute_policy_loss``.

    Returns:
        ``PolicyLossOutput``: ``pg_clipfrac`` the fraction of valid tokens whose ratio is
        clipped, ``ppo_kl`` the mean of the clamped ``old - new`` log-prob,
        ``pg_clipfrac_lower`` 0.
    """
    cliprange_low, cliprange_high = _clip_range(cliprange, cliprange_low, cliprange_high, "compute_policy_loss_cispo")
    log_ratio, ratio = _token_ratio(log_prob, old_log_prob)
    clipped = torch.clamp(ratio, 1.0 - cliprange_low, 1.0 + cliprange_high)
    pg_losses = _weighted(-clipped.detach() * advantages * log_prob, rollout_is_weights)
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        pg_clipfrac = _fraction(ratio != clipped, response_mask, pg_losses)
        ppo_kl = masked_mean(-torch.clamp(log_ratio, min=-LOG_RATIO_BOUND, max=LOG_RATIO_BOUND), response_mask)
    return PolicyLossOutput(pg_loss, pg_clipfrac, ppo_kl, torch.zeros_like(ppo_kl))


def get_policy_loss_fn(name: str) -> Callable[..., PolicyLossOutput]:
    """The policy loss registered under ``name`` (``actor.policy_loss.loss_mode``)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"Unknown policy loss {name!r}; valid names are {list(POLICY_LOSSES)}.")
    return POLICY_LOSSES[name]


# Rollout correction (verl's ``algorithm.rollout_correction``; Yao et al. 2025, "Your efficient
# RL framework secretly brings you off-policy RL training", https://fengyao.notion.site/off-policy-rl;
# Liu, Li et al. 2025, "When speed kills stability", https://richardli.xyz/rl-collapse).
#
# The engine samples from pi_rollout, whose log-probs differ from the trainer's pi_old by
# numerics (bf16 kernels, another attention path). With delta_t = log pi_old(y_t) -
# log pi_rollout(y_t) and rho_t = exp(delta_t), importance weights rho re-weight the loss
# towards pi_old, and rejection drops the tokens or sequences where the two disagree too much.

ROLLOUT_IS_LEVELS: tuple[str, ...] = ("token", "sequence")
"""Valid ``rollout_is`` values (null turns importance weights off)."""

ROLLOUT_RS_OPTIONS: tuple[str, ...] = (
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
)
"""Valid ``rollout_rs`` options (a comma-separated list of them; see
``compute_rollout_rejection_mask``)."""


class RejectionCriterion(NamedTuple):
    """One ``rollout_rs`` option with its bounds: ``lower`` for the log-ratio (k1) options
    only, ``upper`` for all."""

    option: str
    lower: float | None
    upper: float


def _parse_bounds(spec: str | float, key: str) -> tuple[float | None, float]:
    """``"lower_upper"`` or one number -> ``(lower or None, upper)``, positive, lower <= upper."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{key}: expected a number or a 'lower_upper' string, got {spec!r}")
    if isinstance(spec, str):
        parts = spec.strip().split("_")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"{key}: {spec!r} is neither a number nor 'lower_upper' (e.g. '0.5_2.0')") from None
        if len(values) > 2:
            raise ValueError(f"{key}: {spec!r} has more than two bounds; write 'lower_upper' (e.g. '0.5_2.0')")
        lower, upper = (None, values[0]) if len(values) == 1 else values
    else:
        lower, upper = None, float(spec)
    if not (math.isfinite(upper) and upper > 0) or (lower is not None and not (math.isfinite(lower) and lower > 0)):
        raise ValueError(f"{key}: bounds must be positive finite numbers, got {spec!r}")
    if lower is not None and lower > upper:
        raise ValueError(f"{key}: the lower bound of {spec!r} is above the upper bound")
    return lower, upper


def parse_rollout_is_threshold(spec: str | float) -> tuple[float | None, float]:
    """``rollout_is_threshold`` -> ``(lower, upper)``: one number ``C`` gives ``(None, C)``,
    truncation at ``C`` (TIS); ``"lower_upper"`` gives both bounds, and weights outside them
    become 0 (IcePop)."""
    return _parse_bounds(spec, "rollout_is_threshold")


def parse_rollout_rs(rollout_rs: str, rollout_rs_threshold: str | float | None) -> tuple[RejectionCriterion, ...]:
    """``rollout_rs`` / ``rollout_rs_threshold`` -> the criteria, in the order given.

    ``rollout_rs`` is a comma-separated list of ``ROLLOUT_RS_OPTIONS`` (repeats dropped);
    ``rollout_rs_threshold`` one bound specification shared by all of them, or one per option
    (comma-separated). A k1 option takes ``"lower_upper"`` or one number ``C``, meaning
    ``[1/C, C]``; a k2 / k3 option takes one upper bound.
    """
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    if not options:
        raise ValueError(f"rollout_rs: {rollout_rs!r} names no option; valid options are {list(ROLLOUT_RS_OPTIONS)}")
    for o in options:
        if o not in ROLLOUT_RS_OPTIONS:
            raise ValueError(f"rollout_rs: unknown option {o!r}; valid options are {list(ROLLOUT_RS_OPTIONS)}")
    if rollout_rs_threshold is None:
        raise ValueError(f"rollout_rs={rollout_rs!r} needs rollout_rs_threshold")
    specs = ([s.strip() for s in rollout_rs_threshold.split(",")] if isinstance(rollout_rs_threshold, str)
             else [rollout_rs_threshold])
    if len(specs) == 1:
        specs = specs * len(options)
    if len(specs) != len(options):
        raise ValueError(f"rollout_rs_threshold: {len(specs)} bounds for {len(options)} rollout_rs options; "
                         "give one shared bound or one per option")
    criteria = []
    for option, spec in zip(options, specs):
        lower, upper = _parse_bounds(spec, f"rollout_rs_threshold ({option})")
        if option.endswith("k1"):
            if lower is None and upper < 1:
                raise ValueError(f"rollout_rs_threshold ({option}): one number C means the ratio bounds [1/C, C], "
                                 f"empty for C = {upper:g} < 1 (every token rejected); give C >= 1 or "
                                 f"'lower_upper'")
            lower = 1.0 / upper if lower is None else lower
        elif lower is not None:
            raise ValueError(f"rollout_rs_threshold ({option}): a k2 / k3 divergence takes one upper bound, "
                             f"not {spec!r}")
        criteria.append(RejectionCriterion(option, lower, upper))
    return tuple(criteria)


def _log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor,
               clamp: bool = True) -> torch.Tensor:
    """``delta = log pi_old - log pi_rollout`` in at least float32, 0 outside the mask; with
    ``clamp``, clamped to the PPO ratio's ``[-20, 20]`` (exp stays finite)."""
    dtype = _float_dtype(torch.promote_types(old_log_prob.dtype, rollout_log_prob.dtype))
    delta = old_log_prob.to(dtype) - rollout_log_prob.to(dtype)
    return torch.where(mask, delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) if clamp else delta, 0.0)


def _sequence_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` log of the sequence's ratio ``prod_t rho_t``: the sum of the unclamped token
    log-ratios, then clamped to ``[-20, 20]`` (verl's order: tokens of +25 and -24.5 give
    0.5, not 20 - 20)."""
    return _log_ratio(old_log_prob, rollout_log_prob, mask, clamp=False).sum(-1).clamp(-LOG_RATIO_BOUND,
                                                                                        LOG_RATIO_BOUND)


@torch.no_grad()
def compute_rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    lower: float | None,
    upper: float,
) -> torch.Tensor:
    """Importance weights ``pi_old / pi_rollout``, truncated, at token or sequence level.

    ``token``: ``w_t = rho_t``. ``sequence``: ``w_t = prod_s rho_s`` over the sequence's valid
    tokens, the same for all of them: unbiased for a sequence-level objective, with variance
    that grows with the length. Then, with one bound (``lower=None``), truncated importance
    sampling ``min(w, upper)`` (Ionides 2008; "TIS" in Yao et al. 2025); with two, IcePop: ``w``
    where ``lower <= w <= upper`` and 0 elsewhere. The log-ratios are clamped to ``[-20, 20]``
    first; for sequences their sum is, not each term (as verl).

    Args:
        old_log_prob: ``[B, T]`` log-probs of the policy the loss is relative to.
        rollout_log_prob: ``[B, T]`` log-probs of the sampling policy (the engine).
        response_mask: ``[B, T]`` binary.
        rollout_is: ``"token"`` or ``"sequence"``.
        lower, upper: from ``parse_rollout_is_threshold``.

    Returns:
        ``[B, T]`` detached weights in at least float32, 0 outside the mask.
    """
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {list(ROLLOUT_IS_LEVELS)}, got {rollout_is!r}")
    mask = response_mask.bool()
    if rollout_is == "sequence":
        delta = _sequence_log_ratio(old_log_prob, rollout_log_prob, mask)[:, None].expand(mask.shape)
    else:
        delta = _log_ratio(old_log_prob, rollout_log_prob, mask)
    w = torch.exp(delta)
    if lower is None:
        w = w.clamp(max=upper)
    else:
        w = torch.where((w >= lower) & (w <= upper), w, 0.0)
    return torch.where(mask, w, 0.0)


@torch.no_grad()
def normalize_rollout_is_weights(
    weights: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``rollout_is_batch_normalize``: the truncated weights divided by their batch mean.

    The mean is over the valid tokens (``token``) or over the non-empty sequences, one weight
    each (``sequence``), of ``response_mask`` (before rejection, as verl). Where the rows of the
    batch are spread over ranks, ``all_reduce`` (a sum over the ranks of a float64 ``[2]`` tensor) makes
    it the mean over all of them, as verl's ``distributed_masked_mean``. A mean of at most
    ``1e-8`` (all weights 0) leaves the weights as they are, with factor 1.

    Returns:
        ``(weights / factor, factor)``, the factor a 0-dim tensor (no host sync).
    """
    mask = response_mask.bool()
    if rollout_is == "sequence":
        where = mask.any(dim=-1)
        values = masked_mean(weights, mask, axis=-1)
    else:
        where, values = mask, weights
    totals = torch.stack([masked_sum(values, where).double(), where.sum().double()])
    if all_reduce is not None:
        totals = all_reduce(totals)
    mean = (totals[0] / totals[1].clamp_min(1)).to(weights.dtype)
    factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))
    return weights / factor, factor


def _sequence_stat(values: torch.Tensor, mask: torch.Tensor, how: str) -> torch.Tensor:
    """``[B]`` sum, mean or max of ``values`` over each row's valid tokens."""
    if how == "sum":
        return masked_sum(values, mask, axis=-1)
    if how == "mean":
        return masked_mean(values, mask, axis=-1)
    return torch.where(mask, values, -math.inf).max(dim=-1).values


@torch.no_grad()
def compute_rollout_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    criteria: Sequence[RejectionCriterion],
) -> torch.Tensor:
    """Which tokens survive rejection sampling: a hard trust region around ``pi_rollout``.

    Per token, from ``delta_t = log rho_t``::

        k1 = delta_t                  a log-ratio
        k2 = delta_t^2 / 2            >= 0
        k3 = rho_t - 1 - delta_t      >= 0; its mean estimates KL(pi_rollout || pi_old) (Schulman 2020)

    ``token_kX`` judges every token by its own statistic; ``seq_sum_kX`` / ``seq_mean_kX`` /
    ``seq_max_kX`` judge a whole sequence by the sum / mean / max over its valid tokens and keep
    or reject all its tokens together. A k1 statistic passes when it lies in
    ``[log lower, log upper]``: the ratio (token), the product of the ratios (seq_sum) or their
    geometric mean (seq_mean, "Geo-RS") lies in ``[lower, upper]``. A k2 / k3 statistic passes
    when it is at most ``upper``. A token is kept when every criterion passes.

    verl 0.9.1's code compares ``-delta`` with the k1 bounds, i.e. bounds ``1 / rho``; it
    agrees with its documentation (and with this function) for symmetric bounds
    (``lower = 1 / upper``, which a single number gives).

    Args:
        old_log_prob, rollout_log_prob, response_mask: as in ``compute_rollout_is_weights``.
        criteria: from ``parse_rollout_rs``.

    Returns:
        ``[B, T]`` float, 1 for kept tokens, 0 for rejected ones and outside the mask.
    """
    mask = response_mask.bool()
    delta = _log_ratio(old_log_prob, rollout_log_prob, mask)
    keep = mask.clone()
    for criterion in criteria:
        keep &= _passes(_rejection_statistic(delta, mask, criterion.option), criterion)
    return keep.to(delta.dtype)


def _rejection_statistic(delta: torch.Tensor, mask: torch.Tensor, option: str) -> torch.Tensor:
    """``option``'s statistic (``compute_rollout_rejection_mask``): ``[B, T]`` for a token option,
    ``[B, 1]`` for a sequence option (-inf for an empty row's max)."""
    if option not in ROLLOUT_RS_OPTIONS:
        raise ValueError(f"unknown rollout_rs option {option!r}; valid options are {list(ROLLOUT_RS_OPTIONS)}")
    level, kind = option.rsplit("_", 1)
    stat = {"k1": delta, "k2": 0.5 * delta**2, "k3": torch.expm1(delta) - delta}[kind]
    if level != "token":
        stat = _sequence_stat(stat, mask, level.removeprefix("seq_"))[:, None]
    return stat


def _passes(stat: torch.Tensor, criterion: RejectionCriterion) -> torch.Tensor:
    """``[B, T]`` (or ``[B, 1]`` for a sequence criterion) bool: where ``criterion`` passes, given its
    statistic ``stat`` (``_rejection_statistic``)."""
    option, lower, upper = criterion
    if option.endswith("k1"):
        return (stat >= math.log(lower)) & (stat <= math.log(upper))
    return stat <= upper


Figure = Callable[[], torch.Tensor]  # a 0-dim figure, read once its `_Totals` are reduced


def _masked_max(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Max of ``values`` where ``where`` holds; -inf where it holds nowhere (or there is nothing)."""
    masked = torch.where(where, values, -math.inf)
    return masked.amax() if masked.numel() else masked.new_full((), -math.inf)


class _Totals:
    """The masked sums and maxima a call's figures are made of, reduced over the ranks that hold the
    batch's rows: all the sums in one collective, all the maxima in another (a minimum is the max of
    the negated values), in float64. A figure is a function of the reduced totals (a ``Figure``, read
    after ``reduce``), so a figure of every rank's rows is never made of the ranks' own figures: a std
    comes from the sums of x and x^2, a max ignores a rank without a valid token."""

    def __init__(self):
        self._sums: list[torch.Tensor] = []
        self._maxima: list[torch.Tensor] = []
        self._reduced: tuple[torch.Tensor, torch.Tensor] | None = None

    def _slot(self, which: int, value: torch.Tensor) -> Figure:
        store = (self._sums, self._maxima)[which]
        store.append(value.to(torch.float64))
        index = len(store) - 1
        return lambda: self._reduced[which][index]

    def sum(self, values: torch.Tensor, where: torch.Tensor) -> Figure:
        return self._slot(0, masked_sum(values.to(torch.float64), where))

    def count(self, where: torch.Tensor) -> Figure:
        return self._slot(0, where.sum())

    def max(self, values: torch.Tensor, where: torch.Tensor) -> Figure:
        return self._slot(1, _masked_max(values.to(torch.float64), where))

    def mean(self, values: torch.Tensor, where: torch.Tensor) -> Figure:
        """The mean of ``values`` where ``where`` holds; 0 where it holds nowhere (``masked_mean``)."""
        total, count = self.sum(values, where), self.count(where)
        return lambda: total() / count().clamp_min(1)

    def extremes(self, values: torch.Tensor, where: torch.Tensor) -> tuple[Figure, Figure]:
        """Max and min of ``values`` where ``where`` holds (0 and 0 where it holds nowhere)."""
        count, peak, negated_floor = self.count(where), self.max(values, where), self.max(-values, where)
        return (lambda: torch.where(count() > 0, peak(), 0.0),
                lambda: torch.where(count() > 0, -negated_floor(), 0.0))

    def comoment(self, x: torch.Tensor, y: torch.Tensor, where: torch.Tensor) -> Figure:
        """``sum (x - mean x)(y - mean y)`` where ``where`` holds, from the sums of x, y and x y (the
        product of the float64 values: a float32 product's rounding, times n, would be the spread)."""
        x, y = x.to(torch.float64), y.to(torch.float64)
        count, sum_x, sum_y, sum_xy = self.count(where), self.sum(x, where), self.sum(y, where), self.sum(x * y, where)
        return lambda: sum_xy() - sum_x() * sum_y() / count().clamp_min(1)

    def std(self, values: torch.Tensor, where: torch.Tensor, correction: int) -> Figure:
        """The standard deviation of ``values`` where ``where`` holds, population (``correction`` 0) or
        sample (1), and 0 for fewer than two of them."""
        count, squares = self.count(where), self.comoment(values, values, where)
        return lambda: torch.where(count() > 1, (squares().clamp_min(0.0) / (count() - correction).clamp_min(1)).sqrt(),
                                   0.0)

    def reduce(self, all_reduce: Callable[..., torch.Tensor] | None) -> None:
        """Sum the sums and take the max of the maxima over the ranks (``all_reduce(t, op)``); with
        None this call's rows are the whole batch."""
        sums, maxima = torch.stack(self._sums), torch.stack(self._maxima)
        if all_reduce is not None:
            sums, maxima = all_reduce(sums, "sum"), all_reduce(maxima, "max")
        self._reduced = sums, maxima


def _read(figures: dict[str, Figure], totals: _Totals, all_reduce: Callable[..., torch.Tensor] | None
          ) -> dict[str, torch.Tensor]:
    """The figures' values once ``totals`` are reduced (``_Totals.reduce``)."""
    totals.reduce(all_reduce)
    return {name: figure() for name, figure in figures.items()}


def _sequence_summary(values: torch.Tensor, rows: torch.Tensor, prefix: str, totals: _Totals) -> dict[str, Figure]:
    """``<prefix>_seq_{mean,std,max,min}`` of the per-sequence ``values`` over the non-empty rows;
    the std is the sample one (n - 1, as ``torch.std``), 0 for a single row."""
    peak, floor = totals.extremes(values, rows)
    return {f"{prefix}_seq_mean": totals.mean(values, rows), f"{prefix}_seq_std": totals.std(values, rows, 1),
            f"{prefix}_seq_max": peak, f"{prefix}_seq_min": floor}


def _minus_one(figure: Figure) -> Figure:
    return lambda: figure() - 1.0


def _off_policy_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, delta: torch.Tensor,
                        exact_delta: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                        totals: _Totals) -> dict[str, Figure]:
    """The KL, chi-square and perplexity figures of ``compute_rollout_correction``."""
    dtype = delta.dtype
    old = masked_mean(old_log_prob.to(dtype), mask, axis=-1)
    rollout = masked_mean(rollout_log_prob.to(dtype), mask, axis=-1)
    gap = rollout - old  # log(training ppl / rollout ppl) of each sequence
    gap_max, gap_min = totals.extremes(gap, rows)
    seq_delta = exact_delta.sum(-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # `_sequence_log_ratio`'s
    return {
        "rollout_corr/kl": totals.mean(-exact_delta, mask),
        "rollout_corr/k3_kl": totals.mean(torch.expm1(exact_delta) - exact_delta, mask),
        "rollout_corr/chi2_token": _minus_one(totals.mean(torch.exp(2 * delta), mask)),
        "rollout_corr/chi2_seq": _minus_one(totals.mean(torch.exp(2 * seq_delta), rows)),
        "rollout_corr/training_ppl": totals.mean(torch.exp(-old), rows),
        "rollout_corr/rollout_ppl": totals.mean(torch.exp(-rollout), rows),
        "rollout_corr/training_log_ppl": totals.mean(-old, rows),
        "rollout_corr/rollout_log_ppl": totals.mean(-rollout, rows),
        "rollout_corr/log_ppl_diff": totals.mean(gap, rows),
        "rollout_corr/log_ppl_abs_diff": totals.mean(gap.abs(), rows),
        "rollout_corr/log_ppl_diff_max": gap_max,
        "rollout_corr/log_ppl_diff_min": gap_min,
        "rollout_corr/ppl_ratio": totals.mean(torch.exp(gap), rows),
    }


def _effective_sample_size(weights: torch.Tensor, mask: torch.Tensor, totals: _Totals) -> Figure:
    """``1 / mean_t (w / (mean_t w + 1e-8))^2``, written ``(mean_t w + 1e-8)^2 / mean_t w^2``; 0 where
    every weight is 0."""
    mean, mean_square = totals.mean(weights, mask), totals.mean(weights.square(), mask)

    def read():
        second_moment = mean_square() / (mean() + 1e-8).square()
        return torch.where(second_moment > 0, 1.0 / second_moment, 0.0)
    return read


def _is_weight_metrics(weights: torch.Tensor, delta: torch.Tensor, seq_log_ratio: torch.Tensor, mask: torch.Tensor,
                       rows: torch.Tensor, rollout_is: str, lower: float | None, upper: float,
                       totals: _Totals) -> dict[str, Figure]:
    """The ``rollout_is_*`` figures of ``compute_rollout_correction``, of the weights before
    batch normalisation."""
    low = lower if lower is not None else 1.0 / upper
    name = "rollout_corr/rollout_is"
    if rollout_is == "token":
        ratios = torch.where(mask, torch.exp(delta), 0.0)  # before truncation
        high, below = totals.mean(ratios > upper, mask), totals.mean(ratios < low, mask)
        peak, floor = totals.extremes(weights, mask)
    else:  # judged by the unclamped log of each sequence's ratio, as verl
        ratios = torch.where(mask, torch.exp(seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))[:, None], 0.0)
        high = totals.mean(seq_log_ratio > math.log(upper), rows)
        below = totals.mean(seq_log_ratio < math.log(low), rows)
        top, bottom = totals.extremes(seq_log_ratio, rows)
        peak, floor = lambda: torch.exp(top().clamp(max=LOG_RATIO_BOUND)), lambda: torch.exp(bottom())
    per_sequence = masked_mean(weights, mask, axis=-1)
    ratio_means = masked_mean(ratios, mask, axis=-1)
    metrics = {
        f"{name}_mean": totals.mean(weights, mask),
        f"{name}_ratio_fraction_high": high,
        f"{name}_ratio_fraction_low": below,
        f"{name}_max": peak,
        f"{name}_min": floor,
        # verl clamps the weights to [0, upper] for the std and the ESS: truncation left them there
        f"{name}_std": totals.std(weights, mask, 0),
        f"{name}_eff_sample_size": _effective_sample_size(weights, mask, totals),
        **_sequence_summary(per_sequence, rows, name, totals),
        f"{name}_seq_max_deviation": totals.extremes((per_sequence - 1.0).abs(), rows)[0],
        f"{name}_seq_fraction_high": totals.mean(ratio_means > upper, rows),
        f"{name}_seq_fraction_low": totals.mean(ratio_means < low, rows),
    }
    if lower is not None:  # IcePop: the share of tokens whose weight it zeroed
        metrics[f"{name}_oob_ratio"] = totals.mean((ratios < lower) | (ratios > upper), mask)
    return metrics


def _rejection_metrics(criterion: RejectionCriterion, stat: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                       passed: torch.Tensor, totals: _Totals) -> dict[str, Figure]:
    """The ``rollout_rs_<option>_*`` figures of ``compute_rollout_correction`` for one criterion, from
    its statistic ``stat`` (``_rejection_statistic``); ``passed`` is where it passes, ``[B, T]``."""
    option, lower, upper = criterion
    if option.endswith("k1"):
        # verl's k1 is log(pi_rollout / pi_old) = -delta: the bounds this module puts on delta
        # become [-log upper, -log lower] (verl's [log lower, log upper] wherever lower = 1 / upper)
        stat, low, high = -stat, -math.log(upper), -math.log(lower)
    else:
        low, high = None, upper
    per_token = stat.expand_as(mask)  # a sequence option's statistic on each of its tokens
    per_sequence = stat[:, 0] if option.startswith("seq_") else masked_mean(stat, mask, axis=-1)
    judged, where = (per_sequence, rows) if option.startswith("seq_") else (stat, mask)
    peak, floor = totals.extremes(judged, where)
    rejected = mask & ~passed
    name = f"rollout_corr/rollout_rs_{option}"
    metrics = {
        f"{name}_mean": totals.mean(per_token, mask),
        f"{name}_max": peak,
        f"{name}_min": floor,
        f"{name}_fraction_high": totals.mean(judged > high, where),
        f"{name}_fraction_low": (lambda: stat.new_zeros((), dtype=torch.float64)) if low is None
        else totals.mean(judged < low, where),
        f"{name}_std": totals.std(per_token.clamp(0.0 if low is None else low, high), mask, 0),
        **_sequence_summary(per_sequence, rows, name, totals),
        f"{name}_seq_max_deviation": totals.extremes(per_sequence.abs(), rows)[0],
        f"{name}_seq_fraction_high": totals.mean(per_sequence > high, rows),
    }
    if low is not None:
        metrics[f"{name}_seq_fraction_low"] = totals.mean(per_sequence < low, rows)
    metrics[f"{name}_masked_fraction"] = totals.mean(rejected, mask)
    metrics[f"{name}_seq_masked_fraction"] = totals.mean(rejected.any(dim=-1), rows)
    return metrics


@torch.no_grad()
def compute_rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_lower: float | None = None,
    rollout_is_upper: float = 2.0,
    rejection: Sequence[RejectionCriterion] = (),
    batch_normalize: bool = False,
    all_reduce: Callable[..., torch.Tensor] | None = None,
    global_metrics: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]:
    """The importance weights, the rejection mask, and verl's ``rollout_corr/`` metrics.

    The weights (``compute_rollout_is_weights``, None without ``rollout_is``) enter
    ``compute_policy_loss`` / ``compute_policy_loss_reinforce`` as ``rollout_is_weights``. The
    mask (``compute_rollout_rejection_mask``, None without ``rejection``) replaces the response
    mask, as verl's ``modified_response_mask``: a rejected token leaves the loss rather than
    being weighted 0 (a per-sequence token mean counts only the kept tokens). In decoupled mode
    the trainer uses it for everything downstream (advantages, every loss term, the global
    token count that normalises them, the critic); in bypass mode, where it depends on pi_theta, for
    the policy-gradient term only, normalised by the counts of the response mask, as verl's
    ``compute_policy_loss_bypass_mode`` under its global normalisation (``Actor.update``).

    Metrics: the keys of verl 0.9.1's ``compute_rollout_correction_and_rejection_mask``, with its
    definitions, as detached 0-dim tensors (no host sync). ``rho = pi_old / pi_rollout`` per
    token, ``delta = log rho``; "over tokens" means over the valid tokens, "over sequences" over the
    non-empty rows (verl counts empty responses in some figures: the perplexities, ``chi2_seq``,
    ``rollout_is_seq_*``, the sequence-level ``rollout_is_ratio_fraction_*`` and
    ``rollout_rs_seq_masked_fraction``)::

        kl, k3_kl                  mean over tokens of -delta, of rho - 1 - delta: KL(pi_rollout || pi_old)
        chi2_token, chi2_seq       mean over tokens of rho^2, over sequences of (prod_t rho)^2, minus 1
        training_ppl, rollout_ppl             mean over sequences of exp(-mean_t log pi)
        training_log_ppl, rollout_log_ppl     mean over sequences of -mean_t log pi
        log_ppl_diff, log_ppl_abs_diff,       mean, mean |.|, max and min over sequences of
        log_ppl_diff_max, log_ppl_diff_min    mean_t log pi_rollout - mean_t log pi_old
        ppl_ratio                  mean over sequences of exp(that): training / rollout perplexity
      with rollout_is (w: the weights before batch_normalize; r: the ratios before truncation):
        rollout_is_mean, rollout_is_std     mean and population std of w over tokens
        rollout_is_eff_sample_size          1 / mean_t (w / (mean_t w + 1e-8))^2, in (0, 1]; 0 where
                                            every w is 0 (verl raises ZeroDivisionError there)
        rollout_is_max, rollout_is_min      token level: of w over tokens; sequence level: of
                                            prod_t rho over sequences (the max capped at e^20)
        rollout_is_ratio_fraction_high/_low share of tokens (sequences, at sequence level) whose r
                                            is above upper / below lower (1 / upper for TIS)
        rollout_is_seq_mean, _std, _max, _min   of each sequence's mean_t w (sample std)
        rollout_is_seq_max_deviation        max over sequences of |mean_t w - 1|
        rollout_is_seq_fraction_high/_low   share of sequences whose mean_t r is above upper / below lower
        rollout_is_oob_ratio                IcePop only: share of tokens whose r is outside [lower, upper]
        rollout_is_batch_norm_factor        with batch_normalize: the mean the weights were divided
                                            by (``normalize_rollout_is_weights``)
      with rejection, per option (s: its statistic, per token for token_*, per sequence for seq_*,
      with verl's k1 = -delta; [lo, hi]: its bounds on s, k1 [-log upper, -log lower], which is
      verl's [log lower, log upper] wherever lower = 1 / upper, k2 / k3 [0, upper]):
        rollout_rs_<option>_mean            mean over tokens of s (a sequence's s on each of its tokens)
        rollout_rs_<option>_std             population std over tokens of s clamped to [lo, hi]
        rollout_rs_<option>_max, _min       of s over tokens (token_*) or sequences (seq_*)
        rollout_rs_<option>_fraction_high   share of those above hi
        rollout_rs_<option>_fraction_low    share of those below lo (0 for k2 / k3)
        rollout_rs_<option>_seq_mean, _std, _max, _min   of s per sequence (token_*: its token
                                            mean), over sequences (sample std)
        rollout_rs_<option>_seq_max_deviation   max over sequences of |that|
        rollout_rs_<option>_seq_fraction_high   share of sequences above hi (and _seq_fraction_low,
                                            k1 only: below lo)
        rollout_rs_<option>_masked_fraction     share of tokens the option rejects
        rollout_rs_<option>_seq_masked_fraction share of sequences where it rejects a token
        rollout_rs_masked_fraction, rollout_rs_seq_masked_fraction   the same for all options together

    In decoupled mode the trainer calls this once per step on each rank's rows, with
    ``global_metrics``: every figure is of the whole batch, made of the ranks' reduced sums, counts
    and maxima (``_Totals``), in float64. In bypass mode the actor calls this per micro-batch and
    averages every figure, the maxima and minima too, over the micro-batches and ranks, as verl 0.9.1
    does (``Metric`` MEAN).

    Args:
        old_log_prob: ``[B, T]`` the policy the loss is relative to: the recomputed actor
            (decoupled mode) or the policy being trained (bypass mode).
        rollout_log_prob: ``[B, T]`` the engine's log-probs of the sampled tokens.
        response_mask: ``[B, T]`` binary.
        rollout_is: ``"token"``, ``"sequence"`` or None.
        rollout_is_lower, rollout_is_upper: from ``parse_rollout_is_threshold``.
        rejection: from ``parse_rollout_rs``; empty for none.
        batch_normalize: divide the weights by their batch mean (``normalize_rollout_is_weights``).
        all_reduce: where this call sees one rank's rows of the batch, ``all_reduce(t, op)`` reduces a
            tensor over the ranks (``op``: ``"sum"``, the default, or ``"max"``;
            ``sharding.comm.all_reduce``); used for ``batch_normalize`` and, with ``global_metrics``, for
            the metrics. None: this call's rows are the whole batch.
        global_metrics: the metrics of every rank's rows (decoupled mode); else of this call's rows
            (bypass mode, per micro-batch, where the ranks may run unequal numbers of them).

    Returns:
        ``(rollout_is_weights or None, rejection mask or None, metrics)``; the mask is 1 for kept
        tokens, 0 for rejected ones and outside ``response_mask``.
    """
    mask = response_mask.bool()
    exact_delta = _log_ratio(old_log_prob, rollout_log_prob, mask, clamp=False)
    delta = exact_delta.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # `_log_ratio`'s (0 outside the mask either way)
    rows = mask.any(dim=-1)
    totals = _Totals()
    figures = _off_policy_metrics(old_log_prob, rollout_log_prob, delta, exact_delta, mask, rows, totals)
    weights = keep = None
    if rollout_is is not None:
        weights = compute_rollout_is_weights(old_log_prob, rollout_log_prob, response_mask, rollout_is,
                                             rollout_is_lower, rollout_is_upper)
        figures.update(_is_weight_metrics(weights, delta, exact_delta.sum(-1), mask, rows, rollout_is,
                                          rollout_is_lower, rollout_is_upper, totals))
        if batch_normalize:
            weights, factor = normalize_rollout_is_weights(weights, mask, rollout_is, all_reduce)
            figures["rollout_corr/rollout_is_batch_norm_factor"] = lambda: factor
    if rejection:
        keep = mask.clone()
        for criterion in rejection:
            stat = _rejection_statistic(delta, mask, criterion.option)
            passed = _passes(stat, criterion).expand_as(mask)
            figures.update(_rejection_metrics(criterion, stat, mask, rows, passed, totals))
            keep &= passed
        rejected = mask & ~keep
        figures["rollout_corr/rollout_rs_masked_fraction"] = totals.mean(rejected, mask)
        figures["rollout_corr/rollout_rs_seq_masked_fraction"] = totals.mean(rejected.any(dim=-1), rows)
        keep = keep.to(delta.dtype)
    return weights, keep, _read(figures, totals, all_reduce if global_metrics else None)


@torch.no_grad()
def rollout_probs_diff_metrics(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                               all_reduce: Callable[..., torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """verl's rollout-vs-actor debug metrics (``verl.utils.debug.metrics.calculate_debug_metrics``),
    in probability space over ``response_mask``'s tokens: ``d = |exp(old) - exp(rollout)|``::

        training/rollout_probs_diff_valid        1 (verl's constant: the metrics were computed)
        training/rollout_probs_diff_max          max_t d
        training/rollout_probs_diff_mean         mean_t d
        training/rollout_probs_diff_std          the sample standard deviation of d (``torch.std``: n - 1)
        training/rollout_actor_probs_pearson_corr  Pearson's r of (exp(old), exp(rollout)) (``torch.corrcoef``)

    In float64, from the sums of d, d^2, the probabilities, their squares and products (``_Totals``),
    with no host sync: detached 0-dim tensors. NaN where verl's would be undefined (no token: verl's
    max raises; one token's std, a constant's correlation). The trainer passes each rank's rows
    with ``all_reduce`` (as ``compute_rollout_correction``'s), so the figures are of the whole batch."""
    mask = response_mask.bool()
    dtype = torch.float64
    old = torch.where(mask, old_log_prob.to(dtype), 0.0).exp()
    rollout = torch.where(mask, rollout_log_prob.to(dtype), 0.0).exp()
    diff = (old - rollout).abs()
    totals = _Totals()
    count, peak, total = totals.count(mask), totals.max(diff, mask), totals.sum(diff, mask)
    spread = totals.std(diff, mask, 1)
    covariance, old_variance, rollout_variance = (totals.comoment(a, b, mask)
                                                  for a, b in ((old, rollout), (old, old), (rollout, rollout)))

    def correlation():  # torch.corrcoef clips r to [-1, 1] (rounding may put it just outside)
        return (covariance() / (old_variance() * rollout_variance()).sqrt()).clamp(-1.0, 1.0)

    figures = {
        "training/rollout_probs_diff_valid": lambda: torch.ones((), dtype=dtype, device=diff.device),
        "training/rollout_probs_diff_max": lambda: torch.where(count() > 0, peak(), math.nan),
        "training/rollout_probs_diff_mean": lambda: total() / count(),
        "training/rollout_probs_diff_std": lambda: torch.where(count() > 1, spread(), math.nan),
        "training/rollout_actor_probs_pearson_corr": correlation,
    }
    return _read(figures, totals, all_reduce)


class ValueLossOutput(NamedTuple):
    vf_loss: torch.Tensor       # the scalar loss (carries gradient)
    vf_clipfrac: torch.Tensor   # detached fraction of valid tokens where the clipped term is the larger


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs,
) -> ValueLossOutput:
    """PPO's clipped value loss (as in OpenAI baselines' ppo2 and verl).

    ``0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2))``: the critic may not
    gain by moving further than ``c`` from the values it had at rollout time.

    Args:
        vpreds: ``[B, T]`` values predicted by the critic being trained (carry gradient).
        returns: ``[B, T]`` targets (from ``compute_gae_advantage_return``).
        values: ``[B, T]`` values at rollout time.
        response_mask: ``[B, T]`` binary.
        cliprange_value: ``c`` (``critic.cliprange_value``).
        loss_agg_mode, **agg_kwargs: see ``agg_loss``.

    Returns:
        ``ValueLossOutput(vf_loss, vf_clipfrac)``: the scalar loss and the detached fraction of
        valid tokens where the clipped term is the larger one.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpred_clipped - returns) ** 2
    vf_loss = 0.5 * agg_loss(torch.maximum(vf_losses1, vf_losses2), response_mask, loss_agg_mode, **agg_kwargs)
    with torch.no_grad():
        vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(vf_losses1.dtype), response_mask)
    return ValueLossOutput(vf_loss, vf_clipfrac)
