"""Advantage estimators: pure functions on tensors. G = groups, N = samples per group, B = G*N
sequences, T = completion tokens.

Whitening (REINFORCE++, GAE) is over the whole batch: with data-parallel ranks each holding part of
it, pass `all_reduce` (an in-place sum over the ranks) and the mean and std are the whole batch's,
so world size 2 makes the same update as world size 1."""

from __future__ import annotations

from collections.abc import Callable

import torch

AllReduce = Callable[[torch.Tensor], object]  # in-place sum over the data-parallel ranks


def grpo(rewards_GN: torch.Tensor, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: r - mean(group), divided by std(group) when `norm_std`; Dr. GRPO is norm_std=False."""
    centered = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    return centered / (rewards_GN.std(dim=1, keepdim=True) + eps) if norm_std else centered


def rloo(rewards_GN: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's baseline is the mean of the other N-1 samples of its group."""
    n = rewards_GN.shape[1]
    assert n > 1, "RLOO needs at least two samples per group"
    loo_mean = (rewards_GN.sum(dim=1, keepdim=True) - rewards_GN) / (n - 1)
    return rewards_GN - loo_mean


def reinforce_pp(rewards_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None = None,
                 kl_coef: float = 0.0, gamma: float = 1.0, eps: float = 1e-6,
                 all_reduce: AllReduce | None = None) -> torch.Tensor:
    """REINFORCE++: token-level return of (terminal reward - kl_coef * per-token KL), whitened over
    the whole batch's valid tokens (the global baseline). Returns advantages per token, [B, T]."""
    mask = mask_BT.to(torch.float32)
    r_BT = torch.zeros_like(mask)
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()
    r_BT[last] = rewards_B.to(torch.float32)
    if kl_BT is not None and kl_coef:
        r_BT = r_BT - kl_coef * kl_BT * mask
    ret = torch.zeros_like(r_BT)
    running = torch.zeros_like(r_BT[:, 0])
    for t in range(r_BT.shape[1] - 1, -1, -1):
        running = r_BT[:, t] + gamma * running * mask[:, t]
        ret[:, t] = running
    return whiten(ret, mask, eps, all_reduce)


def reinforce_pp_baseline(rewards_GN: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-6,
                          all_reduce: AllReduce | None = None) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline first, then global whitening over valid tokens."""
    centered_B = (rewards_GN - rewards_GN.mean(dim=1, keepdim=True)).reshape(-1)
    mask = mask_BT.to(torch.float32)
    return whiten(centered_B[:, None] * mask, mask, eps, all_reduce)


def gae(rewards_B: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with a terminal reward on each sequence's last valid token; returns (advantages, returns)."""
    mask = mask_BT.to(torch.float32)
    B, T = mask.shape
    r_BT = torch.zeros_like(mask)
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()
    r_BT[last] = rewards_B.to(torch.float32)
    adv = torch.zeros_like(mask)
    running = torch.zeros(B, dtype=torch.float32, device=mask.device)
    values = values_BT.to(torch.float32) * mask
    for t in range(T - 1, -1, -1):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = r_BT[:, t] + gamma * next_v - values[:, t]
        running = (delta + gamma * lam * running * (mask[:, t + 1] if t + 1 < T else 0.0)) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + values) * mask


def whiten(x_BT: torch.Tensor, mask_BT: torch.Tensor, eps: float = 1e-6,
           all_reduce: AllReduce | None = None) -> torch.Tensor:
    """(x - mean) / std over the valid tokens, zero elsewhere (PPO's advantage normalisation).

    std is the unbiased one (torch.std's). Two passes in float64, each summed over all ranks when
    `all_reduce` is given: (count, sum), then the squared deviations from the mean. Fewer than two
    valid tokens in all: x * mask."""
    mask = mask_BT.to(torch.float32)
    x = x_BT.to(torch.float64) * mask
    first = torch.stack([mask.sum(dtype=torch.float64), x.sum()])
    if all_reduce is not None:
        all_reduce(first)
    n, total = first.tolist()
    if n < 2:
        return x_BT * mask
    mean = total / n
    second = (((x - mean) * mask) ** 2).sum().reshape(1)
    if all_reduce is not None:
        all_reduce(second)
    std = (second.item() / (n - 1)) ** 0.5
    return (x_BT - mean) / (std + eps) * mask


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               mask_BT: torch.Tensor, clip: float = 0.2) -> torch.Tensor:
    """PPO value clipping: max of the unclipped and the clipped squared error, token mean."""
    clipped = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    err = torch.maximum((values_BT - returns_BT) ** 2, (clipped - returns_BT) ** 2)
    mask = mask_BT.to(err.dtype)
    return 0.5 * (err * mask).sum() / mask.sum().clamp(min=1)
