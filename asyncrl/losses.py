"""Policy losses with off-policy correction: pure functions on [B, T] tensors.

Notation: logp = log pi_theta (with grad), prox = log pi_prox (the policy the PPO trust region is
around; the current policy before this batch's updates), behav = log mu (the generator's policy that
sampled the tokens, possibly several versions old). Every function returns the per-token loss
[B, T] before aggregation (asyncrl.algorithms.aggregate) and a dict of statistics (0-dim tensors).
"""

from __future__ import annotations

import torch


def _stats(mask_BT, **tensors) -> dict:
    """Masked mean and max of each tensor, as 0-dim tensors (0 when nothing is masked in): no
    device-to-host sync here, so a GPU step is not drained before its backward; callers convert."""
    m = mask_BT.bool()
    n = m.sum()
    out = {}
    for name, t in tensors.items():
        v = t.detach().float()
        out[f"{name}_mean"] = (v * m).sum() / n.clamp(min=1)
        out[f"{name}_max"] = torch.where(n > 0, torch.where(m, v, -torch.inf).max(), 0.0)
    return out


def _frac(flag_BT, mask_BT) -> torch.Tensor:
    """Fraction of the masked-in tokens where `flag` holds, a 0-dim tensor (0 when none)."""
    m = mask_BT.bool()
    return (flag_BT & m).sum() / m.sum().clamp(min=1)


def ppo_clip(logp_BT, prox_BT, adv_BT, mask_BT, clip_low=0.2, clip_high=0.2, dual_clip: float | None = None):
    """PPO-clip with DAPO clip-higher (asymmetric bounds) and optional dual clip (c > 1) that bounds
    the loss of negative-advantage tokens whose ratio blew up."""
    ratio = torch.exp(logp_BT - prox_BT)
    pg1 = -adv_BT * ratio
    pg2 = -adv_BT * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg1, pg2)
    if dual_clip is not None:
        assert dual_clip > 1.0, "dual_clip must be > 1"
        loss = torch.where(adv_BT < 0, torch.minimum(loss, -adv_BT * dual_clip), loss)
    with torch.no_grad():
        stats = _stats(mask_BT, ratio=ratio)
        stats["clip_frac_low"] = _frac((ratio < 1 - clip_low) & (adv_BT < 0), mask_BT)
        stats["clip_frac_high"] = _frac((ratio > 1 + clip_high) & (adv_BT > 0), mask_BT)
    return loss, stats


def behaviour_weight_tis(prox_BT, behav_BT, cap: float):
    """Token-level truncated IS weight min(pi_prox / mu, C), no gradient."""
    with torch.no_grad():
        return torch.exp(prox_BT - behav_BT).clamp(max=cap)


def behaviour_weight_seq_tis(prox_BT, behav_BT, mask_BT, cap: float):
    """Sequence-level truncated IS: min(prod_t pi_prox/mu, C), broadcast to the sequence's tokens."""
    with torch.no_grad():
        log_w_B = ((prox_BT - behav_BT) * mask_BT).sum(dim=1)
        return torch.exp(log_w_B).clamp(max=cap)[:, None].expand_as(prox_BT)


def behaviour_mask_mis(prox_BT, behav_BT, low: float, high: float):
    """Masked IS (MIS / IcePop): tokens whose pi_prox / mu leaves [low, high] get zero weight;
    the others keep weight pi_prox / mu. Returns (weight, kept_mask)."""
    with torch.no_grad():
        w = torch.exp(prox_BT - behav_BT)
        keep = (w >= low) & (w <= high)
        return w * keep, keep


def decoupled_ppo(logp_BT, prox_BT, behav_BT, adv_BT, mask_BT, clip_low, clip_high, is_cap,
                  is_level: str = "token", dual_clip: float | None = None):
    """Decoupled PPO: PPO-clip around pi_prox times a truncated behaviour weight (token or sequence)."""
    loss, stats = ppo_clip(logp_BT, prox_BT, adv_BT, mask_BT, clip_low, clip_high, dual_clip)
    w = (behaviour_weight_tis(prox_BT, behav_BT, is_cap) if is_level == "token"
         else behaviour_weight_seq_tis(prox_BT, behav_BT, mask_BT, is_cap))
    stats.update(_stats(mask_BT, is_weight=w))
    return w * loss, stats


def tis_pg(logp_BT, behav_BT, adv_BT, mask_BT, cap: float):
    """Plain truncated-IS policy gradient: -min(pi/mu, C).detach() * A * log pi."""
    w = behaviour_weight_tis(logp_BT.detach(), behav_BT, cap)
    return -w * adv_BT * logp_BT, _stats(mask_BT, is_weight=w)


def mis_pg(logp_BT, behav_BT, adv_BT, mask_BT, low: float, high: float):
    """Masked-IS policy gradient (IcePop): out-of-band tokens contribute nothing."""
    w, keep = behaviour_mask_mis(logp_BT.detach(), behav_BT, low, high)
    stats = _stats(mask_BT, is_weight=w)
    stats["masked_frac"] = _frac(~keep, mask_BT)
    return -w * adv_BT * logp_BT, stats


def cispo(logp_BT, behav_BT, adv_BT, mask_BT, clip_low: float, clip_high: float):
    """CISPO: REINFORCE with the IS weight pi/mu clipped and detached, so every token keeps a gradient."""
    with torch.no_grad():
        w = torch.exp(logp_BT.detach() - behav_BT).clamp(1 - clip_low, 1 + clip_high)
    return -w * adv_BT * logp_BT, _stats(mask_BT, is_weight=w)


def gspo(logp_BT, prox_BT, adv_BT, mask_BT, clip_low: float, clip_high: float):
    """GSPO: the length-normalised sequence ratio s = exp(mean_t(log pi - log pi_prox)), clipped at the
    sequence level, applied to every token with a per-token gradient of the same size."""
    n_B = mask_BT.sum(dim=1).clamp(min=1)
    log_s_B = ((logp_BT - prox_BT) * mask_BT).sum(dim=1) / n_B
    # s_i,t = sg[s_i] * pi_t / sg[pi_t]: value s_i, gradient through each token.
    s_BT = torch.exp(log_s_B.detach()[:, None] + logp_BT - logp_BT.detach())
    pg1 = -adv_BT * s_BT
    pg2 = -adv_BT * s_BT.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(pg1, pg2)
    s = torch.exp(log_s_B.detach())
    stats = {"seq_ratio_mean": s.mean(), "seq_ratio_max": s.max(),
             "clip_frac": ((s < 1 - clip_low) | (s > 1 + clip_high)).float().mean()}
    return loss, stats


def kl_estimate(logp_BT, ref_BT, kind: str):
    """Per-token KL(pi || pi_ref) estimators from samples of pi: k1 = log r, k2 = (log r)^2 / 2,
    k3 = exp(-log r) - 1 + log r (unbiased, non-negative), with log r = log pi - log pi_ref."""
    log_r = logp_BT - ref_BT
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return torch.exp(-log_r) - 1 + log_r
    raise ValueError(f"algorithm.kl_estimator must be k1, k2 or k3, got {kind!r}")


class AdaptiveKLController:
    """The PPO adaptive KL coefficient (Ziegler et al.): move beta so the measured KL tracks `target`
    over `horizon` samples. Fixed when target is None."""

    def __init__(self, init: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, kl: float, num_samples: int) -> float:
        if self.target is not None and self.target > 0:
            err = max(min(kl / self.target - 1, 0.2), -0.2)
            self.value *= 1 + err * num_samples / self.horizon
        return self.value

    def state(self) -> dict:
        return {"value": self.value}

    def load(self, state: dict) -> None:
        self.value = float(state["value"])
