"""Rollout correction for off-policy tokens: rejection sampling by the IS ratio rho = pi_prox / mu, and
IS weights normalised to mean 1 over the batch. Pure functions on [B, T] tensors.

In an asynchronous run every token was sampled by a generator whose weights lag the learner's (mu),
and by an inference engine whose numerics differ from the learner's; a token or sequence whose rho
is far from 1 carries a high-variance, biased update. Rejection (algorithm.rollout_rs, verl's
`rollout_rs` family) drops it from the loss and from the loss's token / sequence counts; several
criteria chain (a token is kept when every criterion keeps it). Each criterion takes
log_ratio_BT = log pi_prox - log mu and returns the tokens it keeps; `threshold` is t:

- `*_k1`: the ratio (token, sequence product or per-token geometric mean) in [1/t, t], or in
  [lower, t] with algorithm.rollout_rs_lower (asymmetric bounds, e.g. IcePop's [0.5, 5]);
  `seq_max_k1` drops a whole sequence when any of its tokens leaves the band (IcePop-style
  sequence masking; with loss=decoupled_ppo, under decoupled PPO);
- `*_k2` / `*_k3`: a divergence estimate (token, its sequence sum / mean / max) <= t, with
  k2 = (log rho)^2 / 2 and k3 = rho - 1 - log rho, both estimates of KL(mu || pi_prox) from mu's samples.
"""

from __future__ import annotations

import math

import torch

from asyncrl.registry import ROLLOUT_CORRECTIONS

SAFETY_BOUND = 20.0  # |log rho| is clamped here before exp: exp(20) ~ 5e8 still compares finitely


def _token_k2(log_ratio_BT):
    return 0.5 * log_ratio_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND) ** 2


def _token_k3(log_ratio_BT):
    lr = log_ratio_BT.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return torch.exp(lr) - 1 - lr


def _seq_sum(x_BT, mask_BT):
    return (x_BT * mask_BT).sum(dim=1)


def _seq_mean(x_BT, mask_BT):
    return _seq_sum(x_BT, mask_BT) / mask_BT.sum(dim=1).clamp(min=1)


def _seq_max(x_BT, mask_BT):
    """Max of a non-negative statistic over each sequence's valid tokens; 0 for an empty sequence."""
    if x_BT.shape[1] == 0:
        return x_BT.new_zeros(x_BT.shape[0])
    return torch.where(mask_BT.bool(), x_BT, torch.zeros_like(x_BT)).amax(dim=1)


def _in_band(log_x, t: float, lower: float = 0.0):
    """log_x within [log lower, log t]; lower 0 means 1/t (the symmetric band)."""
    return (log_x <= math.log(t)) & (log_x >= (math.log(lower) if lower > 0 else -math.log(t)))


def _per_seq(keep_B, like_BT):
    return keep_B[:, None].expand_as(like_BT)


@ROLLOUT_CORRECTIONS.register("token_k1", ref="verl rollout_rs=token_k1; IcePop (Ling team, 2025)")
def token_k1(log_ratio_BT, mask_BT, threshold: float, lower: float = 0.0):
    """Drop tokens whose ratio pi_prox/mu leaves [1/t, t] (or [rollout_rs_lower, t])."""
    return _in_band(log_ratio_BT, threshold, lower)


@ROLLOUT_CORRECTIONS.register("token_k2", ref="verl rollout_rs=token_k2")
def token_k2(log_ratio_BT, mask_BT, threshold: float):
    """Drop tokens whose (log rho)^2 / 2 exceeds t."""
    return _token_k2(log_ratio_BT) <= threshold


@ROLLOUT_CORRECTIONS.register("token_k3", ref="verl rollout_rs=token_k3")
def token_k3(log_ratio_BT, mask_BT, threshold: float):
    """Drop tokens whose rho - 1 - log rho exceeds t."""
    return _token_k3(log_ratio_BT) <= threshold


@ROLLOUT_CORRECTIONS.register("seq_sum_k1", ref="verl rollout_rs=seq_sum_k1")
def seq_sum_k1(log_ratio_BT, mask_BT, threshold: float, lower: float = 0.0):
    """Drop sequences whose ratio product leaves [1/t, t] (sequence-level IS bounds)."""
    return _per_seq(_in_band(_seq_sum(log_ratio_BT, mask_BT), threshold, lower), log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_sum_k2", ref="verl rollout_rs=seq_sum_k2")
def seq_sum_k2(log_ratio_BT, mask_BT, threshold: float):
    """Drop sequences whose summed k2 exceeds t."""
    return _per_seq(_seq_sum(_token_k2(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_sum_k3", ref="verl rollout_rs=seq_sum_k3")
def seq_sum_k3(log_ratio_BT, mask_BT, threshold: float):
    """Drop sequences whose summed k3 (a sequence KL(mu || pi_prox) estimate) exceeds t."""
    return _per_seq(_seq_sum(_token_k3(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_mean_k1", ref="verl rollout_rs=seq_mean_k1")
def seq_mean_k1(log_ratio_BT, mask_BT, threshold: float, lower: float = 0.0):
    """Drop sequences whose per-token geometric-mean ratio leaves [1/t, t] (length-independent)."""
    return _per_seq(_in_band(_seq_mean(log_ratio_BT, mask_BT), threshold, lower), log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_mean_k2", ref="verl rollout_rs=seq_mean_k2")
def seq_mean_k2(log_ratio_BT, mask_BT, threshold: float):
    """Drop sequences whose mean k2 exceeds t."""
    return _per_seq(_seq_mean(_token_k2(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_mean_k3", ref="verl rollout_rs=seq_mean_k3")
def seq_mean_k3(log_ratio_BT, mask_BT, threshold: float):
    """Drop sequences whose mean k3 exceeds t."""
    return _per_seq(_seq_mean(_token_k3(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_max_k1", ref="IcePop (Ling team, 2025), sequence masking")
def seq_max_k1(log_ratio_BT, mask_BT, threshold: float, lower: float = 0.0):
    """Drop whole sequences holding any token whose ratio leaves [1/t, t] (or [rollout_rs_lower, t])."""
    out_BT = ~_in_band(log_ratio_BT, threshold, lower) & mask_BT.bool()
    return _per_seq(~out_BT.any(dim=1), log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_max_k2", ref="verl rollout_rs=seq_max_k2")
def seq_max_k2(log_ratio_BT, mask_BT, threshold: float):
    """Drop whole sequences holding any token whose k2 exceeds t."""
    return _per_seq(_seq_max(_token_k2(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


@ROLLOUT_CORRECTIONS.register("seq_max_k3", ref="verl rollout_rs=seq_max_k3")
def seq_max_k3(log_ratio_BT, mask_BT, threshold: float):
    """Drop whole sequences holding any token whose k3 exceeds t."""
    return _per_seq(_seq_max(_token_k3(log_ratio_BT), mask_BT) <= threshold, log_ratio_BT)


def _per_criterion(values: list[float], n: int, default: float) -> list[float]:
    return [default] * n if not values else values * n if len(values) == 1 else list(values)


def rejection_mask(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, criteria: list[str],
                   thresholds: list[float], lowers: list[float] | None = None) -> tuple[torch.Tensor, dict]:
    """The tokens every criterion keeps (float, 0 off `mask_BT`) and statistics: the fraction of
    valid tokens rejected, the fraction of non-empty sequences with a token rejected, and each
    criterion's own token rejection fraction (`rs_<name>_frac`). `thresholds`: one, or one per
    criterion; `lowers` (the *_k1 criteria's lower ratio bounds, 0 for 1/t): none, one or one each."""
    assert len(thresholds) in (1, len(criteria)), "one threshold, or one per criterion"
    assert not lowers or len(lowers) in (1, len(criteria)), "one lower bound, or one per criterion"
    valid = mask_BT.bool()
    keep = valid.clone()
    n_tok = valid.sum().clamp(min=1)
    stats = {}
    n = len(criteria)
    for name, t, low in zip(criteria, _per_criterion(thresholds, n, 0.0), _per_criterion(lowers or [], n, 0.0),
                            strict=True):
        args = (float(low),) if name.endswith("k1") else ()
        ok = ROLLOUT_CORRECTIONS.get(name).fn(log_ratio_BT, mask_BT.to(log_ratio_BT.dtype), float(t), *args)
        stats[f"rs_{name}_frac"] = (valid & ~ok).sum() / n_tok
        keep &= ok
    has_tokens_B = valid.any(dim=1)
    hit_B = (valid & ~keep).any(dim=1)
    stats["rs_token_reject_frac"] = (valid & ~keep).sum() / n_tok
    stats["rs_seq_reject_frac"] = hit_B.sum() / has_tokens_B.sum().clamp(min=1)
    return keep.to(mask_BT.dtype), stats


def batch_mean_weight(w_BT: torch.Tensor, mask_BT: torch.Tensor, level: str) -> torch.Tensor:
    """The mean IS weight the batch normalisation divides by (algorithm.is_normalize): over valid
    tokens (`token`), or over non-empty sequences, one weight each (`sequence`). 1 when nothing is
    valid or the mean is ~0, so a degenerate batch is left unscaled."""
    m = mask_BT.to(w_BT.dtype)
    if level == "sequence":
        has_B = m.sum(dim=1) > 0
        seq_w_B = (w_BT * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        mean = (seq_w_B * has_B).sum() / has_B.sum().clamp(min=1)
    else:
        mean = (w_BT * m).sum() / m.sum().clamp(min=1)
    return torch.where(mean > 1e-8, mean, torch.ones_like(mean))
