"""Advantage estimators: pure functions on tensors. G = groups, N = samples per group, B = G*N
sequences, T = completion tokens.

Whitening (REINFORCE++, GAE) is over the whole batch: with data-parallel ranks each holding part of
it, pass `all_reduce` (an in-place sum over the ranks) and the mean and std are the whole batch's,
so world size 2 makes the same update as world size 1.

The registered estimators (asyncrl/registry.py ADVANTAGES, the values of algorithm.advantage) take
one `AdvantageInputs` and return (advantages_BT, returns_BT or None); the functions they call take
tensors and numbers only. A KL-in-reward penalty (algorithm.kl_in=reward) arrives per token: the
token-level estimators (REINFORCE++, GAE) subtract it at each token, which is what credit
assignment over the sequence needs; the outcome estimators (one score per sample) subtract its
sequence sum, which for them is the same thing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from asyncrl.registry import ADVANTAGES

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig

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
        lam: float = 0.95, kl_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE with a terminal reward on each sequence's last valid token, minus `kl_BT` (a per-token
    penalty, already scaled) at every token; returns (advantages, returns)."""
    mask = mask_BT.to(torch.float32)
    B, T = mask.shape
    r_BT = torch.zeros_like(mask)
    last = (mask.cumsum(dim=1) == mask.sum(dim=1, keepdim=True)) & mask.bool()
    r_BT[last] = rewards_B.to(torch.float32)
    if kl_BT is not None:
        r_BT = r_BT - kl_BT.to(torch.float32) * mask
    adv = torch.zeros_like(mask)
    running = torch.zeros(B, dtype=torch.float32, device=mask.device)
    values = values_BT.to(torch.float32) * mask
    for t in range(T - 1, -1, -1):
        next_v = values[:, t + 1] if t + 1 < T else torch.zeros_like(running)
        delta = r_BT[:, t] + gamma * next_v - values[:, t]
        running = (delta + gamma * lam * running * (mask[:, t + 1] if t + 1 < T else 0.0)) * mask[:, t]
        adv[:, t] = running
    return adv, (adv + values) * mask


def grpo_passk(rewards_GN: torch.Tensor, norm_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Pass@k training: only each group's best sample gets an advantage, r_max - r_second (divided
    by the group's std when `norm_std`); the others get 0. A tie at the top gives 0 to everyone."""
    assert rewards_GN.shape[1] > 1, "pass@k needs at least two samples per group"
    top2, idx = rewards_GN.topk(2, dim=1)
    gap_G = top2[:, 0] - top2[:, 1]
    if norm_std:
        gap_G = gap_G / (rewards_GN.std(dim=1) + eps)
    return torch.zeros_like(rewards_GN).scatter(1, idx[:, :1], gap_G[:, None])


def opo(rewards_GN: torch.Tensor, lengths_GN: torch.Tensor) -> torch.Tensor:
    """OPO: r minus the length-weighted group mean sum(l_i r_i) / sum(l_i), the variance-optimal
    baseline for a sequence-level reward under exact on-policy sampling. A group of empty completions
    falls back to the plain mean."""
    w = lengths_GN.to(rewards_GN.dtype)
    total = w.sum(dim=1, keepdim=True)
    weighted = (w * rewards_GN).sum(dim=1, keepdim=True) / total.clamp(min=1e-12)
    baseline = torch.where(total > 0, weighted, rewards_GN.mean(dim=1, keepdim=True))
    return rewards_GN - baseline


def gpg(rewards_GN: torch.Tensor) -> torch.Tensor:
    """GPG: group-mean-centred reward times alpha = B / (samples with a non-zero reward), which
    undoes the dilution of the batch gradient by samples that carry no signal."""
    alpha = rewards_GN.numel() / max(int(torch.count_nonzero(rewards_GN)), 1)
    return alpha * (rewards_GN - rewards_GN.mean(dim=1, keepdim=True))


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


def optimal_token_baseline(scores_B: torch.Tensor, mask_BT: torch.Tensor, logp_BT: torch.Tensor,
                           sum_pi2_BT: torch.Tensor, group_size: int, kl_BT: torch.Tensor | None = None,
                           eps: float = 1e-8, is_weights_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Optimal token baseline: a baseline per token position and group, weighted by each sample's
    realized energy. G_t is the return to go (the outcome reward minus the KL penalties from t on),
    w_t = 1 - 2 pi(a_t) + sum_v pi_v^2 (the squared norm of the logit gradient of log pi(a_t)),
    W_t = w_1 + ... + w_t, and B_t = sum_i G_t W_t / sum_i W_t over the group's samples still
    running at t. Where a single sample is still running its baseline is 0 (it would be its own
    return). Advantage G_t - B_t on valid tokens. B = G * group_size rows in group order.
    `is_weights_BT` (the loss's truncated IS weight rho of each token): off-policy samples, each
    token's energy scaled by rho^2, the weighting that minimises the baseline's error under truncated
    importance sampling (verl's OTB with rollout IS weights)."""
    m = mask_BT.to(scores_B.dtype)
    returns = scores_B[:, None] * m
    if kl_BT is not None:
        returns = returns - (kl_BT * m).flip(1).cumsum(1).flip(1) * m
    w = (1 - 2 * logp_BT.exp() + sum_pi2_BT) * m
    if is_weights_BT is not None:
        w = w * is_weights_BT.to(w.dtype) ** 2
    W = w.cumsum(1) * m
    G, N, T = scores_B.numel() // group_size, group_size, mask_BT.shape[1]
    ret_GNT, W_GNT, m_GNT = returns.view(G, N, T), W.view(G, N, T), m.view(G, N, T)
    baseline_GT = (ret_GNT * W_GNT).sum(1) / (W_GNT.sum(1) + eps)
    baseline_GT = torch.where(m_GNT.sum(1) > 1, baseline_GT, torch.zeros_like(baseline_GT))
    return ((ret_GNT - baseline_GT[:, None, :]) * m_GNT).view(G * N, T)


def tir_optimal_token_baseline(scores_B: torch.Tensor, mask_BT: torch.Tensor, logp_BT: torch.Tensor,
                               sum_pi2_BT: torch.Tensor, group_size: int, kl_BT: torch.Tensor | None = None,
                               eps: float = 1e-8, is_weights_BT: torch.Tensor | None = None) -> torch.Tensor:
    """The optimal token baseline for tool-integrated rollouts, whose loss mask has holes (tool
    output inside a completion is not the model's and is masked out): samples are aligned by the
    index of the model's own token (its k-th generated token), not by the position in the row, so
    B_k averages the group's returns at their k-th token. Each row's valid tokens are packed to the
    left, `optimal_token_baseline` runs on the packed rows, and the advantages go back to their
    positions. Without holes it is `optimal_token_baseline` exactly."""
    m = mask_BT.bool()
    B, T = mask_BT.shape
    k_BT = (m.cumsum(dim=1) - 1).clamp(min=0)  # each valid token's index among its row's valid tokens
    width = int(m.sum(dim=1).max()) if B else 0

    def pack(x_BT):
        out = x_BT.new_zeros(B, width)
        rows = torch.arange(B, device=x_BT.device)[:, None].expand(B, T)
        out[rows[m], k_BT[m]] = x_BT[m]
        return out

    packed_mask = (torch.arange(width, device=mask_BT.device)[None, :] < m.sum(dim=1, keepdim=True)).to(mask_BT.dtype)
    adv = optimal_token_baseline(scores_B, packed_mask, pack(logp_BT), pack(sum_pi2_BT), group_size,
                                 None if kl_BT is None else pack(kl_BT), eps,
                                 None if is_weights_BT is None else pack(is_weights_BT))
    out = torch.zeros(B, T, dtype=adv.dtype, device=adv.device)
    rows = torch.arange(B, device=adv.device)[:, None].expand(B, T)
    out[m] = adv[rows[m], k_BT[m]]
    return out


def gdpo(rewards_GNK: torch.Tensor, weights_K: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """GDPO: each reward component k normalised within its group, (r_k - mean_g r_k) / (std_g r_k + eps),
    then summed (weighted by `weights_K`), then the sums whitened over the batch's samples, so one
    component's scale or variance cannot drown the others' (summing first, as GRPO on a summed
    reward does, collapses distinct reward combinations onto one advantage). [G, N] out."""
    r = rewards_GNK.to(torch.float64)
    per_k = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps) if r.shape[1] > 1 else r * 0
    w = torch.ones(r.shape[-1], dtype=r.dtype, device=r.device) if weights_K is None else weights_K.to(r.dtype)
    summed = (per_k * w).sum(dim=-1)
    if summed.numel() < 2:
        return summed.to(rewards_GNK.dtype)
    return ((summed - summed.mean()) / (summed.std() + eps)).to(rewards_GNK.dtype)


def pf_ppo_weights(scores_B: torch.Tensor, method: str, power: float = 2.0) -> torch.Tensor:
    """PF-PPO's per-sample weights from the reward, normalised to mean 1 over the batch: `pow`
    |r|^power, `max_min` 1 for the batch's best and worst reward and 0 otherwise, `max_random` 0.4
    for the best and 0.1 otherwise, `scores_B` the reward after DAPO's overlong penalty (verl's
    token-level scores). PF-PPO (verl) resamples B samples with replacement with these probabilities,
    so sample i is drawn w_i / mean(w) times in expectation: the weight `pf_ppo_loss_weights` turns
    into each sequence's multiplier on every term of its loss."""
    if method == "pow":
        w = scores_B.abs() ** power
    elif method == "max_min":
        w = ((scores_B == scores_B.max()) | (scores_B == scores_B.min())).to(scores_B.dtype)
    elif method == "max_random":
        w = torch.where(scores_B == scores_B.max(), 0.4, 0.1).to(scores_B.dtype)
    else:
        raise ValueError(f"algorithm.pf_ppo: {method!r} is not one of ['pow', 'max_min', 'max_random']")
    w = w + 1e-8  # all-zero weights (every reward 0 under pow) leave the batch unweighted
    return w / w.mean()


def pf_ppo_loss_weights(weights_B: torch.Tensor, tokens_B: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Each sequence's multiplier on its loss terms under `aggregation`, from `pf_ppo_weights` (mean 1,
    the expected draws of verl's resampling) and `tokens_B`, each sequence's counted tokens. The
    sequence aggregations and token_sum take them as they are: the loss is linear in the draws, so
    the weighted loss is the resampled one's expectation. token_mean divides by the resampled batch's
    token count, itself drawn: the weights are rescaled to a token mean of 1, so the weighted loss is
    E[token sum] / E[token count] of the resampled batch (the ratio of expectations, as the batch grows)."""
    if aggregation != "token_mean":
        return weights_B
    counted = (weights_B * tokens_B).sum()
    # No token counted (every sequence empty or rejected): nothing to rescale, and no device sync to ask.
    return weights_B * torch.where(counted > 0, tokens_B.sum() / counted.clamp(min=1e-30), 1.0)


def remax(scores_B: torch.Tensor, baselines_B: torch.Tensor, mask_BT: torch.Tensor,
          kl_BT: torch.Tensor | None = None) -> torch.Tensor:
    """ReMax: each token's return to go (the outcome reward minus the KL penalties from t on) minus
    `baselines_B`, the reward of the greedy completion of the sample's prompt; zero past each
    sequence's end. Without a KL penalty that is r_i - b on every valid token (verl
    compute_remax_outcome_advantage)."""
    m = mask_BT.to(scores_B.dtype)
    returns = scores_B[:, None] * m
    if kl_BT is not None:
        returns = returns - (kl_BT * m).flip(1).cumsum(1).flip(1) * m
    return (returns - baselines_B.to(scores_B.dtype)[:, None]) * m


# ---- the registry: algorithm.advantage -------------------------------------------------------------


@dataclass
class AdvantageInputs:
    """The whole step's inputs of an estimator (every rank holds them). B = G*N, in group order."""

    scores_GN: torch.Tensor  # each sample's (shaped) outcome reward
    mask_BT: torch.Tensor  # valid completion tokens
    alg: AlgorithmConfig
    kl_BT: torch.Tensor | None = None  # kl_in=reward: kl_coef * the per-token KL, subtracted as a reward
    values_BT: torch.Tensor | None = None  # the critic's values of the behaviour batch (gae)
    all_reduce: AllReduce | None = None
    logp_BT: torch.Tensor | None = None  # needs_sum_pi2: log pi of each sampled token (the learner's weights)
    sum_pi2_BT: torch.Tensor | None = None  # needs_sum_pi2: sum_v pi_v^2 of each token's distribution
    baselines_G: torch.Tensor | None = None  # greedy_baseline: each group's greedy completion's reward
    is_weights_BT: torch.Tensor | None = None  # algorithm.otb_is_weights: the loss's truncated IS weight per token

    def outcome_GN(self) -> torch.Tensor:
        """Scores minus each sequence's summed KL penalty (the outcome estimators' reward)."""
        if self.kl_BT is None:
            return self.scores_GN
        return self.scores_GN - (self.kl_BT * self.mask_BT).sum(dim=1).view_as(self.scores_GN)

    def per_token(self, adv_GN: torch.Tensor) -> torch.Tensor:
        return adv_GN.reshape(-1)[:, None] * self.mask_BT


@ADVANTAGES.register("grpo", ref="DeepSeekMath (arXiv:2402.03300)")
def _grpo(x: AdvantageInputs):
    """Group baseline: (r - group mean) / group std, one value per sample."""
    return x.per_token(grpo(x.outcome_GN(), norm_std=True)), None


@ADVANTAGES.register("dr_grpo", ref="Dr. GRPO (arXiv:2503.20783)")
def _dr_grpo(x: AdvantageInputs):
    """GRPO without the std division (pair with aggregation=seq_mean_token_sum_norm)."""
    return x.per_token(grpo(x.outcome_GN(), norm_std=False)), None


@ADVANTAGES.register("grpo_passk", ref="Pass@k Training (arXiv:2503.19595); verl grpo_passk")
def _grpo_passk(x: AdvantageInputs):
    """Pass@k: only the group's best sample is credited, by its margin over the second best."""
    return x.per_token(grpo_passk(x.outcome_GN(), norm_std=x.alg.passk_norm_std)), None


@ADVANTAGES.register("rloo", ref="Ahmadian et al. 2024 (arXiv:2402.14740)")
def _rloo(x: AdvantageInputs):
    """Leave-one-out baseline: r minus the mean of the group's other samples."""
    return x.per_token(rloo(x.outcome_GN())), None


@ADVANTAGES.register("opo", ref="OPO (arXiv:2505.23585)")
def _opo(x: AdvantageInputs):
    """Length-weighted group-mean baseline (the optimal baseline for sequence rewards)."""
    return x.per_token(opo(x.outcome_GN(), x.mask_BT.sum(dim=1).view_as(x.scores_GN))), None


@ADVANTAGES.register("gpg", ref="GPG (arXiv:2504.02546)")
def _gpg(x: AdvantageInputs):
    """Group-mean-centred reward rescaled by batch / non-zero-reward samples (pair with loss=gpg)."""
    return x.per_token(gpg(x.outcome_GN())), None


@ADVANTAGES.register("reinforce_pp", ref="REINFORCE++ (arXiv:2501.03262)")
def _reinforce_pp(x: AdvantageInputs):
    """Token-level discounted return (algorithm.gamma) of reward minus per-token KL, whitened over the batch."""
    kl_coef = 1.0 if x.kl_BT is not None else 0.0
    return reinforce_pp(x.scores_GN.reshape(-1), x.mask_BT, x.kl_BT, kl_coef, x.alg.gamma,
                        all_reduce=x.all_reduce), None


@ADVANTAGES.register("reinforce_pp_baseline", ref="REINFORCE++ (arXiv:2501.03262)")
def _reinforce_pp_baseline(x: AdvantageInputs):
    """Group-mean baseline, then whitening over the batch's tokens."""
    return reinforce_pp_baseline(x.outcome_GN(), x.mask_BT, all_reduce=x.all_reduce), None


@ADVANTAGES.register("optimal_token_baseline", ref="Optimal Token Baseline (arXiv:2602.07078); verl optimal_token_baseline",
                     needs_sum_pi2=True)
def _optimal_token_baseline(x: AdvantageInputs):
    """A per-token group baseline weighted by accumulated gradient energy (one extra no-grad pass for sum pi^2)."""
    assert x.logp_BT is not None and x.sum_pi2_BT is not None, "optimal_token_baseline needs log pi and sum pi^2"
    group_size = x.scores_GN.shape[1]
    return optimal_token_baseline(x.scores_GN.reshape(-1), x.mask_BT, x.logp_BT, x.sum_pi2_BT, group_size,
                                  x.kl_BT, is_weights_BT=x.is_weights_BT), None


@ADVANTAGES.register("tir_optimal_token_baseline", ref="Optimal Token Baseline (arXiv:2602.07078); verl "
                     "tir_optimal_token_baseline", needs_sum_pi2=True)
def _tir_optimal_token_baseline(x: AdvantageInputs):
    """The optimal token baseline aligned by the model's own token index, for masks with tool-output holes."""
    assert x.logp_BT is not None and x.sum_pi2_BT is not None, "tir_optimal_token_baseline needs log pi and sum pi^2"
    group_size = x.scores_GN.shape[1]
    return tir_optimal_token_baseline(x.scores_GN.reshape(-1), x.mask_BT, x.logp_BT, x.sum_pi2_BT, group_size,
                                      x.kl_BT, is_weights_BT=x.is_weights_BT), None


@ADVANTAGES.register("gdpo", ref="GDPO (arXiv:2601.05242)")
def _gdpo(x: AdvantageInputs):
    """Group-normalised per reward component, summed, whitened over the batch (one component: the scalar reward)."""
    return x.per_token(gdpo(x.outcome_GN()[..., None])), None


@ADVANTAGES.register("remax", ref="ReMax (arXiv:2310.10505); verl remax", greedy_baseline=True)
def _remax(x: AdvantageInputs):
    """Greedy baseline: r minus the reward of the prompt's greedy completion (one more generation per prompt, not trained)."""
    assert x.baselines_G is not None, "advantage=remax needs each group's greedy baseline reward"
    num_samples = x.scores_GN.shape[1]
    baselines_B = x.baselines_G.to(x.scores_GN.dtype).repeat_interleave(num_samples)
    return remax(x.scores_GN.reshape(-1), baselines_B, x.mask_BT, x.kl_BT), None


@ADVANTAGES.register("gae", ref="GAE (arXiv:1506.02438); PPO", critic=True)
def _gae(x: AdvantageInputs):
    """Critic baseline: GAE(gamma, lam) over tokens, whitened; the critic is fitted to the returns."""
    assert x.values_BT is not None, "advantage=gae needs the critic's values of the batch"
    adv, returns = gae(x.scores_GN.reshape(-1), x.values_BT, x.mask_BT, x.alg.gamma, x.alg.lam, x.kl_BT)
    return whiten(adv, x.mask_BT, all_reduce=x.all_reduce), returns


def estimate(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """algorithm.advantage's (advantages_BT, returns_BT or None)."""
    return ADVANTAGES.get(x.alg.advantage).fn(x)
