"""Advantages and policy losses: pure functions on tensors, shapes in the names.

B = sequences in the batch, T = completion tokens (padded), G = groups, N = samples per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grpo_advantages(rewards_GN: torch.Tensor, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: reward minus the group mean, divided by the group std when `norm_std` (Dr. GRPO: not)."""
    centered = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not norm_std:
        return centered
    return centered / (rewards_GN.std(dim=1, keepdim=True) + eps)


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """token_mean: mean over all tokens; seq_mean_token_mean: per-sequence mean, then mean over
    sequences; seq_mean_token_sum: per-sequence sum, then mean over sequences."""
    if mode == "token_mean":
        return masked_mean(loss_BT, mask_BT)
    per_seq_sum_B = (loss_BT * mask_BT).sum(dim=1)
    if mode == "seq_mean_token_sum":
        return per_seq_sum_B.mean()
    if mode == "seq_mean_token_mean":
        return (per_seq_sum_B / mask_BT.sum(dim=1).clamp(min=1)).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


@dataclass
class LossStats:
    ratio_mean: float
    ratio_max: float
    is_weight_mean: float
    is_weight_max: float
    ess: float  # effective sample size of the behaviour weights, as a fraction of tokens (1 = on-policy)
    clip_frac: float
    is_capped_frac: float


def decoupled_ppo_loss(
    logp_BT: torch.Tensor,
    prox_logp_BT: torch.Tensor,
    behav_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    is_cap: float,
    aggregation: str = "token_mean",
) -> tuple[torch.Tensor, LossStats]:
    """Decoupled PPO: PPO-clip against the proximal policy, times a truncated behaviour weight.

    loss_t = -min(pi_prox/mu, C) * min(r_t A, clip(r_t, 1-clip_low, 1+clip_high) A),
    r_t = pi_theta / pi_prox. The weight corrects for the generator's stale policy mu; the clip keeps
    the update near pi_prox. With pi_prox == mu (no staleness) it is plain PPO.
    """
    mask_BT = mask_BT.to(logp_BT.dtype)
    ratio_BT = torch.exp(logp_BT - prox_logp_BT)
    with torch.no_grad():
        raw_w_BT = torch.exp(prox_logp_BT - behav_logp_BT)
        w_BT = raw_w_BT.clamp(max=is_cap)
    adv_BT = adv_B[:, None].to(logp_BT.dtype)
    unclipped = ratio_BT * adv_BT
    clipped = ratio_BT.clamp(1 - clip_low, 1 + clip_high) * adv_BT
    loss_BT = -w_BT * torch.minimum(unclipped, clipped)
    loss = aggregate(loss_BT, mask_BT, aggregation)
    with torch.no_grad():
        m = mask_BT.bool()
        w = w_BT[m]
        r = ratio_BT[m]
        stats = LossStats(
            ratio_mean=float(r.mean()) if r.numel() else 1.0,
            ratio_max=float(r.max()) if r.numel() else 1.0,
            is_weight_mean=float(w.mean()) if w.numel() else 1.0,
            is_weight_max=float(w.max()) if w.numel() else 1.0,
            ess=float(w.sum() ** 2 / (w.numel() * (w**2).sum()).clamp(min=1e-12)) if w.numel() else 1.0,
            clip_frac=float(((clipped < unclipped)[m]).float().mean()) if r.numel() else 0.0,
            is_capped_frac=float((raw_w_BT[m] > is_cap).float().mean()) if r.numel() else 0.0,
        )
    return loss, stats


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float,
                   chunk: int = 1024) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`, computed in fp32 over row chunks so the full
    B x T x V fp32 tensor is never materialised at once."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    tgt = targets_BT.reshape(-1)
    out = []
    for i in range(0, flat.shape[0], chunk):
        rows = flat[i:i + chunk].float() / temperature
        out.append(rows.gather(1, tgt[i:i + chunk, None]).squeeze(1) - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).view_as(targets_BT)
