"""Per-token KL(pi || pi_ref) estimators from tokens sampled from pi: pure functions on [B, T] tensors.

log r = log pi - log pi_ref. k1 and k3 are unbiased estimates of the KL's value, but their gradient
is not the KL's gradient in expectation; k2's is (Schulman, "Approximating KL divergence", 2020). The
`+` variants keep the k1 / k3 value and take k2's gradient (straight-through), as verl's `k1+`/`k3+`.
"""

from __future__ import annotations

import torch

from asyncrl.registry import KL_ESTIMATORS


@KL_ESTIMATORS.register("k1", ref="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def k1(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """log r: unbiased value, high variance, can be negative."""
    return logp_BT - ref_BT


@KL_ESTIMATORS.register("k2", ref="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def k2(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """(log r)^2 / 2: biased value, low variance; its gradient is the KL's gradient in expectation."""
    return 0.5 * (logp_BT - ref_BT) ** 2


@KL_ESTIMATORS.register("k3", ref="Schulman 2020, http://joschu.net/blog/kl-approx.html")
def k3(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """exp(-log r) - 1 + log r: unbiased, non-negative, low variance (verl's low_var_kl, unclamped)."""
    log_r = logp_BT - ref_BT
    return torch.exp(-log_r) - 1 + log_r


@KL_ESTIMATORS.register("abs", ref="verl kl_penalty('abs')")
def abs_kl(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """|log r|: a non-negative penalty on the log-ratio's size (not an unbiased KL estimate)."""
    return (logp_BT - ref_BT).abs()


def _straight_through(value_BT: torch.Tensor, logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    grad_BT = k2(logp_BT, ref_BT)
    return value_BT.detach() + grad_BT - grad_BT.detach()


@KL_ESTIMATORS.register("k1+", ref="verl kl_penalty('k1+'); Schulman 2020")
def k1_plus(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """k1's value with k2's gradient (straight-through): unbiased value and gradient."""
    return _straight_through(k1(logp_BT, ref_BT), logp_BT, ref_BT)


@KL_ESTIMATORS.register("k3+", ref="verl kl_penalty('k3+'); Schulman 2020")
def k3_plus(logp_BT: torch.Tensor, ref_BT: torch.Tensor) -> torch.Tensor:
    """k3's value with k2's gradient (straight-through): low-variance value, unbiased gradient."""
    return _straight_through(k3(logp_BT, ref_BT), logp_BT, ref_BT)


def kl_estimate(logp_BT: torch.Tensor, ref_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """The per-token estimate `kind` (algorithm.kl_estimator)."""
    return KL_ESTIMATORS.get(kind).fn(logp_BT, ref_BT)
