"""Policy losses with off-policy correction: pure functions on [B, T] tensors.

Notation: logp = log pi_theta (with grad), prox = log pi_prox (the policy the PPO trust region is
around; the current policy before this batch's updates), behav = log mu (the generator's policy that
sampled the tokens, possibly several versions old). Every function returns the per-token loss
[B, T] before aggregation (asyncrl/algorithms/aggregation.py) and a dict of statistics (0-dim tensors).

The registered entries (asyncrl/registry.py POLICY_LOSSES, the values of algorithm.loss) take one
`LossInputs` and read their options from the algorithm config; the functions they call take tensors
and numbers only; called without the behaviour log-probs they are the loss's on-policy form.

Every entry corrects for the lag between mu and pi_prox, and declares how in `correction=` (the kinds
are asyncrl/registry.py CORRECTIONS): most multiply their proximal objective by the truncated
behaviour weight min(pi_prox / mu, C) (`behaviour_weight`, token or sequence by algorithm.is_level),
the sequence objectives by its geometric-mean form, and the losses whose own ratio is taken against
mu (ppo, cispo, dppo_*) or that leash log pi to log mu (dro) need nothing more. The behaviour weight
is evaluated at pi_prox, fixed for the step: it is what algorithm.is_normalize divides by its batch
mean (`is_weight_at_prox`), so the normaliser and the weights it normalises are at the same policy.
With one update per step pi_prox is the current policy (the value, without gradient), so with
mu = pi_prox every entry is its on-policy form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from asyncrl.registry import IS_WEIGHT_CORRECTIONS, POLICY_LOSSES

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig


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
    """Sequence-level truncated IS: min(prod_t pi_prox/mu, C), broadcast to the sequence's tokens.
    `mask_BT` is every response token of the sequence (before any rejection): the weight of a
    sequence is that of the whole sampled sequence, whichever of its tokens the loss then keeps."""
    with torch.no_grad():
        log_w_B = ((prox_BT - behav_BT) * mask_BT).sum(dim=1).clamp(max=math.log(cap))
        return torch.exp(log_w_B)[:, None].expand_as(prox_BT)


def behaviour_weight_seq_geo(prox_BT, behav_BT, mask_BT, cap: float):
    """Length-normalised sequence IS weight min(exp(mean_t log pi_prox/mu), C), broadcast to the
    sequence's tokens: the behaviour part of GSPO's / GMPO's geometric-mean ratio against mu,
    (pi / mu)^(1/|y|) = (pi / pi_prox)^(1/|y|) * (pi_prox / mu)^(1/|y|). 1 for an empty row."""
    with torch.no_grad():
        n_B = mask_BT.sum(dim=1).clamp(min=1)
        log_w_B = (((prox_BT - behav_BT) * mask_BT).sum(dim=1) / n_B).clamp(max=math.log(cap))
        return torch.exp(log_w_B)[:, None].expand_as(prox_BT)


def behaviour_mask_mis(prox_BT, behav_BT, low: float, high: float):
    """Masked IS (MIS / IcePop): tokens whose pi_prox / mu leaves [low, high] get zero weight;
    the others keep weight pi_prox / mu. Returns (weight, kept_mask)."""
    with torch.no_grad():
        w = torch.exp(prox_BT - behav_BT)
        keep = (w >= low) & (w <= high)
        return w * keep, keep


def decoupled_ppo(logp_BT, prox_BT, behav_BT, adv_BT, mask_BT, clip_low, clip_high, is_cap,
                  is_level: str = "token", dual_clip: float | None = None, valid_BT=None):
    """Decoupled PPO: PPO-clip around pi_prox times a truncated behaviour weight (token or sequence;
    the sequence product runs over `valid_BT`, every response token, default `mask_BT`)."""
    loss, stats = ppo_clip(logp_BT, prox_BT, adv_BT, mask_BT, clip_low, clip_high, dual_clip)
    w = (behaviour_weight_tis(prox_BT, behav_BT, is_cap) if is_level == "token"
         else behaviour_weight_seq_tis(prox_BT, behav_BT, mask_BT if valid_BT is None else valid_BT, is_cap))
    stats.update(_stats(mask_BT, is_weight=w))
    return w * loss, stats


def tis_pg(logp_BT, behav_BT, adv_BT, mask_BT, cap: float, prox_BT=None, w_BT=None):
    """Truncated-IS policy gradient: -min(pi/mu, C).detach() * A * log pi. Decoupled form (with
    `prox_BT`): the behaviour part min(pi_prox/mu, C) is held at pi_prox for the step (or is `w_BT`,
    e.g. its sequence-level form) and the drift since pi_prox rides on top, sg(pi / pi_prox); at
    pi = pi_prox the two forms are equal."""
    if prox_BT is None:
        w = behaviour_weight_tis(logp_BT.detach(), behav_BT, cap)
    else:
        w = (behaviour_weight_tis(prox_BT, behav_BT, cap) if w_BT is None else w_BT) \
            * torch.exp(logp_BT.detach() - prox_BT)
    return -w * adv_BT * logp_BT, _stats(mask_BT, is_weight=w)


def mis_pg(logp_BT, behav_BT, adv_BT, mask_BT, low: float, high: float, prox_BT=None):
    """Masked-IS policy gradient (IcePop): out-of-band tokens contribute nothing. Decoupled form
    (with `prox_BT`): the band and weight are on pi_prox / mu, fixed for the step, times sg(pi / pi_prox)."""
    w, keep = behaviour_mask_mis(logp_BT.detach() if prox_BT is None else prox_BT, behav_BT, low, high)
    if prox_BT is not None:
        w = w * torch.exp(logp_BT.detach() - prox_BT)
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


def geo_mean_ppo(logp_BT, prox_BT, adv_BT, mask_BT, clip_low: float, clip_high: float):
    """GMPO: maximise A * exp(mean_t clip(log r_t)), the geometric mean of the token ratios, each
    log-ratio clipped to [-clip_low, clip_high] on the side the advantage pushes (sign(A)). Per-token
    form: value -A * s on every token, gradient -A * s * d clip(log r_t); with seq_mean_token_mean
    this is exactly the sequence objective. A is each sequence's mean advantage."""
    n_B = mask_BT.sum(dim=1).clamp(min=1)
    adv_B = (adv_BT * mask_BT).sum(dim=1) / n_B
    sgn = torch.sign(adv_B)[:, None]
    log_r = logp_BT - prox_BT
    clipped = log_r.clamp(-clip_low, clip_high)
    log_r_min = sgn * torch.minimum(sgn * log_r, sgn * clipped)
    log_s_B = (log_r_min * mask_BT).sum(dim=1) / n_B
    s_BT = torch.exp(log_s_B.detach()[:, None] + log_r_min - log_r_min.detach())
    loss = -adv_B[:, None] * s_BT
    with torch.no_grad():
        s = torch.exp(log_s_B)
        clip = (log_r != clipped)
        stats = {"seq_ratio_mean": s.mean() if s.numel() else s.sum(), "seq_ratio_max": s.max() if s.numel() else s.sum(),
                 "clip_frac_high": _frac(clip & (adv_BT > 0), mask_BT), "clip_frac_low": _frac(clip & (adv_BT < 0), mask_BT)}
    return loss, stats


def sapo(logp_BT, prox_BT, adv_BT, mask_BT, tau_pos: float, tau_neg: float):
    """SAPO: a smooth gate instead of the hard clip, -A * sigmoid(tau (r - 1)) * 4 / tau, with tau_pos
    for A > 0 and tau_neg otherwise; at r = 1 its gradient is the plain policy gradient, and it fades
    (rather than stops) as r leaves 1."""
    ratio = torch.exp((logp_BT - prox_BT).clamp(-20.0, 20.0))
    tau = torch.where(adv_BT > 0, torch.full_like(adv_BT, tau_pos), torch.full_like(adv_BT, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv_BT, _stats(mask_BT, ratio=ratio.detach())


def gpg(logp_BT, adv_BT, mask_BT):
    """GPG: the plain policy gradient -A * log pi, no ratio, no clip (the advantage carries the correction)."""
    return -adv_BT * logp_BT, {}


def clip_cov(logp_BT, prox_BT, adv_BT, mask_BT, clip_low: float, clip_high: float, ratio: float, lb: float,
             ub: float, generator: torch.Generator | None = None):
    """Clip-Cov: PPO-clip, and the gradient of a random max(1, ratio * tokens) of the tokens whose
    centred covariance (A - mean A)(log pi - mean log pi) lies in (lb, ub), among those PPO did not
    clip, is detached (their loss is kept, their update dropped) to stop entropy collapse."""
    r = torch.exp(logp_BT - prox_BT)
    pg1, pg2 = -adv_BT * r, -adv_BT * r.clamp(1 - clip_low, 1 + clip_high)
    valid = mask_BT.bool()
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        cov = (adv_BT - (adv_BT * mask_BT).sum() / n) * (logp_BT.detach() - (logp_BT.detach() * mask_BT).sum() / n)
        cand = (valid & ~(pg2 > pg1) & (cov > lb) & (cov < ub)).reshape(-1).nonzero().squeeze(1)
        num = max(int(ratio * int(valid.sum())), 1)
        if cand.numel():
            cand = cand[torch.randperm(cand.numel(), generator=generator, device="cpu")[:num].to(cand.device)]
        corr = torch.ones(mask_BT.numel(), dtype=logp_BT.dtype, device=logp_BT.device)
        corr[cand] = 0.0
        corr = corr.view_as(mask_BT)
    loss = torch.maximum(pg1, pg2)
    loss = corr * loss + (1 - corr) * loss.detach()
    stats = _stats(mask_BT, ratio=r.detach())
    stats["cov_clip_frac"] = _frac(corr == 0, mask_BT)
    return loss, stats


def kl_cov(logp_BT, prox_BT, adv_BT, mask_BT, ratio: float, coef: float):
    """KL-Cov: the policy gradient -A * r, plus coef * |log r| on the max(1, ratio * tokens) tokens of
    largest centred covariance (A - mean A)(log pi - mean log pi): a KL leash where entropy collapses."""
    log_r = logp_BT - prox_BT
    r = torch.exp(log_r)
    valid = mask_BT.bool()
    loss = -adv_BT * r
    with torch.no_grad():
        n = valid.sum().clamp(min=1)
        cov = (adv_BT - (adv_BT * mask_BT).sum() / n) * (logp_BT.detach() - (logp_BT.detach() * mask_BT).sum() / n)
        n_valid = int(valid.sum())
        pick = torch.zeros(mask_BT.numel(), dtype=torch.bool, device=mask_BT.device)
        if n_valid:
            flat_idx = valid.reshape(-1).nonzero().squeeze(1)
            top = cov.reshape(-1)[flat_idx].topk(max(1, int(n_valid * ratio))).indices
            pick[flat_idx[top]] = True
        pick = pick.view_as(mask_BT)
    loss = torch.where(pick, loss + coef * log_r.abs(), loss)
    stats = _stats(mask_BT, ratio=r.detach())
    stats["cov_kl_frac"] = _frac(pick, mask_BT)
    return loss, stats


def dppo(logp_BT, prox_BT, adv_BT, mask_BT, low: float, high: float, ratio_cap: float, divergence: str,
         behav_BT=None):
    """DPPO: the truncated-IS policy gradient -A * sg(min(r, C)) * log pi, with the trust region as a
    mask on the token's own probability change rather than on the ratio: `tv` keeps a token while
    pi - pi_old <= high (A > 0) / >= -low (A < 0); `kl` while the binary KL between Bernoulli(pi_old)
    and Bernoulli(pi) is <= high (A > 0) / low (A < 0) or the move is away from the advantage.
    pi_old is pi_prox (the trust region); the IS ratio r is pi / mu with `behav_BT` (the policy that
    sampled the token), else pi / pi_prox."""
    log_r = (logp_BT - prox_BT).clamp(-20.0, 20.0)
    with torch.no_grad():
        log_w = log_r if behav_BT is None else (logp_BT.detach() - behav_BT).clamp(-20.0, 20.0)
        w = torch.exp(log_w).clamp(max=ratio_cap)
        p, p_old = torch.exp(logp_BT.detach()), torch.exp(prox_BT)
        if divergence == "tv":
            keep_pos, keep_neg = (p - p_old) <= high, (p - p_old) >= -low
        else:
            bkl = p_old * (prox_BT - logp_BT.detach()) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            keep_pos, keep_neg = (bkl <= high) | (p <= p_old), (bkl <= low) | (p >= p_old)
        keep = torch.where(adv_BT > 0, keep_pos, keep_neg)
    stats = _stats(mask_BT, ratio=torch.exp(log_r.detach()))
    stats["trust_masked_frac"] = _frac(~keep, mask_BT)
    return -adv_BT * w * logp_BT * keep, stats


def dro(logp_BT, behav_BT, adv_BT, mask_BT, beta: float):
    """DRO-style quadratic leash: -A * log pi + beta / 2 * (log pi - log mu)^2. The penalty pulls
    each token's log-prob back towards the policy that sampled it, which keeps a stale sample's
    update small without an IS weight; at pi = mu it is the plain policy gradient."""
    d = logp_BT - behav_BT
    stats = _stats(mask_BT, log_ratio_abs=d.detach().abs())
    return -adv_BT * logp_BT + 0.5 * beta * d**2, stats


# ---- the registry: algorithm.loss -----------------------------------------------------------------


@dataclass
class LossInputs:
    """One micro-batch's tensors for a registered loss, [b, T] each."""

    logp_BT: torch.Tensor  # log pi_theta, with grad
    prox_BT: torch.Tensor  # log pi_prox (the policy before this step's updates)
    behav_BT: torch.Tensor  # log mu (the generator's)
    adv_BT: torch.Tensor
    mask_BT: torch.Tensor  # the tokens the loss trains (rejection sampling applied)
    alg: AlgorithmConfig
    valid_BT: torch.Tensor | None = None  # every response token (before rejection); None: mask_BT

    @property
    def valid(self) -> torch.Tensor:
        return self.mask_BT if self.valid_BT is None else self.valid_BT


def behaviour_weight(alg: AlgorithmConfig, prox_BT, behav_BT, valid_BT) -> torch.Tensor:
    """The behaviour IS weight of algorithm.loss at pi_prox (no gradient), [B, T]: its declared
    `correction` (asyncrl/registry.py CORRECTIONS). Sequence forms run over `valid_BT`, every
    response token, so a token-level rejection does not change a sequence's weight."""
    kind = POLICY_LOSSES.static_meta(alg.loss).get("correction")
    if kind == "behaviour_weight":
        if alg.is_level == "token":
            return behaviour_weight_tis(prox_BT, behav_BT, alg.is_cap)
        return behaviour_weight_seq_tis(prox_BT, behav_BT, valid_BT, alg.is_cap)
    if kind == "seq_geo_weight":
        return behaviour_weight_seq_geo(prox_BT, behav_BT, valid_BT, alg.is_cap)
    if kind == "masked_weight":
        return behaviour_mask_mis(prox_BT, behav_BT, alg.mis.low, alg.mis.high)[0]
    raise ValueError(f"algorithm.loss={alg.loss} corrects by {kind!r}, not by a behaviour IS weight")


def _weighted(x: LossInputs, out):
    """(w * loss, stats + is_weight): a proximal objective times the step's behaviour weight."""
    loss, stats = out
    w = behaviour_weight(x.alg, x.prox_BT, x.behav_BT, x.valid)
    stats.update(_stats(x.mask_BT, is_weight=w))
    return w * loss, stats


@POLICY_LOSSES.register("decoupled_ppo", ref="Hilton et al. 2022 (arXiv:2110.00641); AReaL (arXiv:2505.24298)",
                        correction="behaviour_weight")
def _decoupled_ppo(x: LossInputs):
    """PPO-clip around pi_prox times a truncated behaviour weight min(pi_prox/mu, C) (token or sequence)."""
    a = x.alg
    return decoupled_ppo(x.logp_BT, x.prox_BT, x.behav_BT, x.adv_BT, x.mask_BT, a.clip_low, a.clip_high, a.is_cap,
                         a.is_level, a.dual_clip or None, valid_BT=x.valid)


@POLICY_LOSSES.register("ppo", ref="Schulman et al. 2017 (arXiv:1707.06347); DAPO clip-higher; dual clip "
                        "(arXiv:1912.09729)", correction="ratio_vs_behaviour")
def _ppo(x: LossInputs):
    """Plain PPO-clip with the behaviour policy as the old policy (clip-higher, optional dual clip)."""
    a = x.alg
    return ppo_clip(x.logp_BT, x.behav_BT, x.adv_BT, x.mask_BT, a.clip_low, a.clip_high, a.dual_clip or None)


@POLICY_LOSSES.register("tis", ref="Yao et al. 2025, Off-policy RL (fengyao.notion.site/off-policy-rl)",
                        correction="behaviour_weight")
def _tis(x: LossInputs):
    """REINFORCE with the truncated IS weight min(pi/mu, C), detached (held at pi_prox across a step's updates)."""
    w = behaviour_weight(x.alg, x.prox_BT, x.behav_BT, x.valid)
    return tis_pg(x.logp_BT, x.behav_BT, x.adv_BT, x.mask_BT, x.alg.is_cap, prox_BT=x.prox_BT, w_BT=w)


@POLICY_LOSSES.register("mis", ref="IcePop (Ling team, 2025); MIS (arXiv:2510.18855)", correction="masked_weight")
def _mis(x: LossInputs):
    """REINFORCE with IS weight pi/mu, tokens outside [mis.low, mis.high] masked out."""
    return mis_pg(x.logp_BT, x.behav_BT, x.adv_BT, x.mask_BT, x.alg.mis.low, x.alg.mis.high, prox_BT=x.prox_BT)


@POLICY_LOSSES.register("cispo", ref="MiniMax-M1 (arXiv:2506.13585)", correction="ratio_vs_behaviour")
def _cispo(x: LossInputs):
    """REINFORCE with the clipped, detached IS weight pi/mu: every token keeps a gradient."""
    return cispo(x.logp_BT, x.behav_BT, x.adv_BT, x.mask_BT, x.alg.clip_low, x.alg.clip_high)


@POLICY_LOSSES.register("gspo", ref="GSPO (arXiv:2507.18071)", correction="seq_geo_weight")
def _gspo(x: LossInputs):
    """Sequence-level clipped ratio exp(mean_t log pi/pi_prox); use with seq_mean_token_mean."""
    return _weighted(x, gspo(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, x.alg.clip_low, x.alg.clip_high))


@POLICY_LOSSES.register("gmpo", ref="GMPO (arXiv:2507.20673)", correction="seq_geo_weight")
def _gmpo(x: LossInputs):
    """Geometric mean of the token ratios, token-clipped in log space; use with seq_mean_token_mean."""
    return _weighted(x, geo_mean_ppo(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, x.alg.clip_low, x.alg.clip_high))


@POLICY_LOSSES.register("sapo", ref="SAPO (arXiv:2511.20347)", correction="behaviour_weight")
def _sapo(x: LossInputs):
    """Soft-gated ratio sigmoid(tau (r - 1)) * 4 / tau instead of the hard clip (sapo.tau_pos / tau_neg)."""
    return _weighted(x, sapo(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, x.alg.sapo.tau_pos, x.alg.sapo.tau_neg))


@POLICY_LOSSES.register("gpg", ref="GPG (arXiv:2504.02546)", correction="behaviour_weight")
def _gpg(x: LossInputs):
    """Plain policy gradient -A log pi (pair with advantage=gpg)."""
    return _weighted(x, gpg(x.logp_BT, x.adv_BT, x.mask_BT))


@POLICY_LOSSES.register("clip_cov", ref="Cui et al., The Entropy Mechanism of RL for LLMs (arXiv:2505.22617)",
                        correction="behaviour_weight")
def _clip_cov(x: LossInputs):
    """PPO-clip that also detaches a few high-covariance tokens (cov.ratio, cov.lb, cov.ub) to keep entropy."""
    a = x.alg
    return _weighted(x, clip_cov(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, a.clip_low, a.clip_high, a.cov.ratio,
                                 a.cov.lb, a.cov.ub))


@POLICY_LOSSES.register("kl_cov", ref="Cui et al., The Entropy Mechanism of RL for LLMs (arXiv:2505.22617)",
                        correction="behaviour_weight")
def _kl_cov(x: LossInputs):
    """Policy gradient plus a |log r| penalty on the highest-covariance tokens (cov.ratio, cov.kl_coef)."""
    return _weighted(x, kl_cov(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, x.alg.cov.ratio, x.alg.cov.kl_coef))


@POLICY_LOSSES.register("dppo_tv", ref="DPPO (arXiv:2602.04879)", correction="ratio_vs_behaviour")
def _dppo_tv(x: LossInputs):
    """Truncated-IS policy gradient, trust region as a mask on the probability change |pi - pi_old|."""
    a = x.alg
    return dppo(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, a.clip_low, a.clip_high, a.dppo.ratio_cap, "tv",
                behav_BT=x.behav_BT)


@POLICY_LOSSES.register("dppo_kl", ref="DPPO (arXiv:2602.04879)", correction="ratio_vs_behaviour")
def _dppo_kl(x: LossInputs):
    """Truncated-IS policy gradient, trust region as a mask on the binary KL of the token's probability."""
    a = x.alg
    return dppo(x.logp_BT, x.prox_BT, x.adv_BT, x.mask_BT, a.clip_low, a.clip_high, a.dppo.ratio_cap, "kl",
                behav_BT=x.behav_BT)


@POLICY_LOSSES.register("dro", ref="DRO, Richemond et al. 2024 (arXiv:2405.19107)", correction="quadratic_leash")
def _dro(x: LossInputs):
    """Policy gradient plus beta/2 (log pi - log mu)^2, a leash to the sampling policy (dro.beta)."""
    return dro(x.logp_BT, x.behav_BT, x.adv_BT, x.mask_BT, x.alg.dro.beta)


def policy_loss(x: LossInputs):
    """Per-token loss [b, T] and statistics of algorithm.loss."""
    return POLICY_LOSSES.get(x.alg.loss).fn(x)


def is_weight_at_prox(alg: AlgorithmConfig, prox_BT, behav_BT, valid_BT) -> tuple[torch.Tensor, str]:
    """The behaviour IS weight the loss `alg.loss` applies, evaluated at pi_prox over every response
    token `valid_BT`, and its level (token / sequence): what algorithm.is_normalize averages to
    rescale the loss, and what the optimal token baseline scales by with otb_is_weights."""
    kind = POLICY_LOSSES.static_meta(alg.loss).get("correction")
    if kind not in IS_WEIGHT_CORRECTIONS:
        raise ValueError(f"algorithm.is_normalize needs a loss with a behaviour IS weight, got algorithm.loss={alg.loss}")
    level = "sequence" if kind == "seq_geo_weight" or (kind == "behaviour_weight" and alg.is_level == "sequence") \
        else "token"
    return behaviour_weight(alg, prox_BT, behav_BT, valid_BT), level


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
