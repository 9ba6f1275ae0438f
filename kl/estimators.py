"""Per-token estimators of KL(pi || pi_ref) from sampled-token log-probabilities.

Every estimator sees only the log-probability of the token that was sampled from the
current policy ``pi``, under ``pi`` (``logprob``) and under the frozen reference policy
(``ref_logprob``); none needs the full vocabulary distribution. The names follow verl's
``algorithm.kl_penalty`` / ``actor.kl_loss_type`` options and John Schulman's note
"Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), which calls them
k1, k2 and k3.

A name ending in ``"+"`` (``"k3+"``, ``"low_var_kl+"``, ...) is a straight-through
variant: the forward value is the named estimator, the gradient is k2's. k2's pathwise
gradient, ``(logp - ref) * grad(logp)``, is in expectation over sampled tokens exactly the
gradient of KL(pi || pi_ref), whereas the gradients of k1 and k3 are not (k1's has
expectation zero; k3's follows KL(pi_ref || pi)). The "+" variants therefore report and
penalise the low-variance value while optimising the right objective when used as a loss.
"""

import torch

__all__ = ["kl_penalty", "VALID_KL_PENALTIES"]

# Base estimators; each also exists with a "+" suffix (see module docstring).
_BASE_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")

VALID_KL_PENALTIES: tuple[str, ...] = _BASE_NAMES + tuple(name + "+" for name in _BASE_NAMES)
"""Every name ``kl_penalty`` accepts; configs validate against this tuple."""

LOW_VAR_KL_MAX = 10.0
"""The per-token bound of ``"low_var_kl"`` / ``"k3"`` (verl's clamp): no mean of it exceeds this."""


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def _forward_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        # Unbiased for KL(pi||ref) under tokens sampled from pi; high variance, can be negative.
        return logprob - ref_logprob
    if name == "abs":
        # Biased upwards (E|x| >= |E x|), never negative; a heuristic, not a KL estimator.
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        # Biased (bias is third order in log(pi/ref)), low variance, never negative.
        return _k2(logprob, ref_logprob)
    if name in ("low_var_kl", "k3"):
        # Unbiased for KL(pi||ref) and never negative, with much lower variance than k1.
        log_ratio = torch.clamp(ref_logprob - logprob, min=-20.0, max=20.0)
        kld = torch.exp(log_ratio) - log_ratio - 1.0
        # verl's clamp: one token whose probabilities differ by e^20 must not dominate the batch.
        return torch.clamp(kld, min=-LOW_VAR_KL_MAX, max=LOW_VAR_KL_MAX)
    raise AssertionError(f"unreachable: {name!r} was validated by kl_penalty")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate between the current and the reference policy.

    Args:
        logprob: ``[B, T]`` log pi(a_t | s_t) of the sampled tokens (any shape works).
        ref_logprob: ``[B, T]`` log pi_ref(a_t | s_t) of the same tokens.
        kl_penalty: estimator name, one of ``VALID_KL_PENALTIES``:
            ``"kl"``/``"k1"``: ``logp - ref``;
            ``"abs"``: ``|logp - ref|``;
            ``"mse"``/``"k2"``: ``0.5 * (logp - ref)^2``;
            ``"low_var_kl"``/``"k3"``: ``exp(d) - d - 1`` with ``d = ref - logp`` clamped to
            ``[-20, 20]`` and the result clamped to ``[-10, 10]`` (Schulman's k3);
            any of these with a ``"+"`` suffix: that value forward, k2's gradient backward.

    Returns:
        ``[B, T]`` per-token estimate, unmasked (the caller applies ``response_mask``).

    Raises:
        ValueError: for ``"full"`` (needs full-vocabulary distributions, which meshppo does
            not keep) and for any unknown name.
    """
    if kl_penalty == "full":
        raise ValueError(
            "kl_penalty='full' is not supported: it needs the full-vocabulary distributions of "
            f"both policies, which meshppo does not materialise. Use one of {list(VALID_KL_PENALTIES)}."
        )
    if kl_penalty not in VALID_KL_PENALTIES:
        raise ValueError(f"Unknown kl_penalty {kl_penalty!r}; valid names are {list(VALID_KL_PENALTIES)}.")

    straight_through = kl_penalty.endswith("+")
    name = kl_penalty[:-1] if straight_through else kl_penalty
    value = _forward_value(logprob, ref_logprob, name)
    if not straight_through:
        return value
    # verl's form: the zero-valued k2 term carries the gradient and the value is added as it is.
    # `k2 + (value - k2).detach()` rounds away a small value next to a large k2 in low precision
    # (bf16: logp=-0.05, ref=-100.3 gave "k3+" 0 where "k3" gives 10).
    k2 = _k2(logprob, ref_logprob)
    return (k2 - k2.detach()) + value.detach()
