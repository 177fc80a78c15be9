"""The learner's optimisation of one step's batch, free of Redis and of the learner's own messages.

`Learner.train_step` builds the step (learners/batch.py), plans its mini- and micro-batches
(learners/packing.py) and reduces the stats across ranks around `policy_update`;
`benchmarks/learner_throughput.py` times exactly these functions. Under FSDP2 the model's own hooks
(all-gather, reduce-scatter) and the gradient-norm reduction run inside them.

Before the first update (`batch_targets`): reference, proximal and critic passes over the
micro-batches (no grad), shared by every rank (one all-reduce of N floats each) -> shaped rewards
(overlong penalty, KL-in-reward) -> advantages over the whole step (algorithm.advantage). Then each
mini-batch: per micro-batch, log-probs under pi_theta (chunked) -> per-token loss (algorithm.loss)
-> + KL-in-loss -> sum normalised by the mini-batch's global token or sequence count -> backward
(gradients accumulate); then clip -> optimizer step -> scheduler step. With advantage=gae the critic's
values give the advantages, and the critic is fitted to the returns (learners/critic.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl.algorithms import advantages as adv_fns
from asyncrl.algorithms import kl as kl_fns
from asyncrl.algorithms import losses
from asyncrl.algorithms import rollout_correction as rc
from asyncrl.algorithms.aggregation import aggregate_normalised
from asyncrl.protocol import torch_private
from asyncrl.registry import ADVANTAGES
from learners.batch import StepBatch, micro_batch
from learners.logprobs import micro_logprobs, micro_logprobs_sum_pi2

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig, Config
    from learners.batch import MicroBatch
    from learners.packing import StepPlan


def rank_micro_batches(plan: StepPlan, rank: int) -> list[list[int]]:
    """This rank's micro-batches of the first epoch: each of the step's sequences once (on some
    rank), the same count on every rank. The no-grad passes before the first update run over them."""
    return [seqs for mb in plan.epochs[0] for seqs in mb.micro[rank]]


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def forward_N(fn, step: StepBatch, micro: list[list[int]], packed: bool, pad_id: int, width: int = 0) -> torch.Tensor:
    """`fn(micro_batch)` (a flat tensor of its completion tokens' values; n x `width` with a width)
    over this rank's micro-batches, without grad, gathered into the step's N positions and summed
    over the ranks, so every rank holds the values of every sequence."""
    out = torch.zeros((step.num_tokens, width) if width else step.num_tokens, dtype=torch.float32, device=step.device)
    with torch.no_grad():
        for seqs in micro:
            mb = micro_batch(step, seqs, packed, pad_id)
            vals = fn(mb)
            if mb.seqs:
                out.index_copy_(0, mb.flat_N, vals.float())
    return all_reduce_sum(out)


def logprobs_N(model: nn.Module, step: StepBatch, micro: list[list[int]], cfg: Config, pad_id: int) -> torch.Tensor:
    """Log-probs of every completion token of the step under `model` (no grad), N floats."""
    was_training = model.training
    model.eval()
    try:
        return forward_N(lambda mb: micro_logprobs(model, mb, cfg.generator.temperature), step, micro,
                         cfg.learner.packing, pad_id)
    finally:
        model.train(was_training)


def logprobs_sum_pi2_N(model: nn.Module, step: StepBatch, micro: list[list[int]], cfg: Config,
                       pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, sum_v pi_v^2) of every completion token of the step under `model`, N floats each
    (one no-grad pass; advantage estimators with `needs_sum_pi2`)."""
    was_training = model.training
    model.eval()
    try:
        both = forward_N(lambda mb: micro_logprobs_sum_pi2(model, mb, cfg.generator.temperature), step, micro,
                         cfg.learner.packing, pad_id, width=2)
    finally:
        model.train(was_training)
    return both[:, 0].contiguous(), both[:, 1].contiguous()


def shaped_rewards(step: StepBatch, alg: AlgorithmConfig, max_tokens: int) -> torch.Tensor:
    """Rewards after DAPO overlong shaping (the KL-in-reward penalty comes per token, `batch_targets`)."""
    r_S = step.rewards_S.to(torch.float32).clone()
    if alg.overlong_buffer > 0:
        # Linear penalty over the last `overlong_buffer` tokens before max_tokens (DAPO soft punishment);
        # an episode's length is its policy tokens.
        length_S = torch.tensor(step.policy_len, dtype=torch.float32, device=r_S.device)
        start = max_tokens - alg.overlong_buffer
        r_S -= alg.overlong_penalty * ((length_S - start).clamp(min=0) / alg.overlong_buffer).clamp(max=1.0)
    return r_S


@dataclass
class Targets:
    """What every update of one step is fitted to, fixed before the first update; N floats each."""

    adv_N: torch.Tensor
    prox_N: torch.Tensor | None  # log pi_prox, when computed ahead (several updates, KL-in-reward, corrections)
    ref_N: torch.Tensor | None = None  # log pi_ref, when a KL term needs it
    returns_N: torch.Tensor | None = None  # advantage=gae: the critic's regression targets
    values_N: torch.Tensor | None = None  # advantage=gae: the critic's values before the step
    keep_N: torch.Tensor | None = None  # algorithm.rollout_rs: 1 for the tokens the loss keeps, else 0
    is_scale: torch.Tensor | None = None  # algorithm.is_normalize: the batch-mean IS weight the loss divides by
    stats: dict = field(default_factory=dict)  # whole-step statistics (rejection fractions, IS normaliser)
    weight_N: torch.Tensor | None = None  # algorithm.pf_ppo: each token's sequence weight on every policy-loss term
    value_weight_N: torch.Tensor | None = None  # the same under critic_aggregation, on the value loss


def rollout_correction(step: StepBatch, prox_N: torch.Tensor, alg: AlgorithmConfig) -> tuple:
    """(keep_N or None, is_scale or None, stats): rejection sampling by pi_prox / mu and the batch
    mean of the loss's IS weight over the kept tokens (asyncrl/algorithms/rollout_correction.py).
    The weight itself is that of every response token (a sequence weight is the product over the
    whole sequence, before rejection), as the loss computes it; only its mean is over the kept ones.
    Over the policy's tokens alone (`step.policy`)."""
    pv = step.policy
    mask_ST = pv.mask()
    prox_ST, behav_ST = pv.grid(prox_N), pv.grid(step.behav_N.float())
    keep_ST, stats = mask_ST, {}
    if alg.rollout_rs:
        keep_ST, stats = rc.rejection_mask(prox_ST - behav_ST, mask_ST, alg.rollout_rs, alg.rollout_rs_threshold,
                                           alg.rollout_rs_lower)
    scale = None
    if alg.is_normalize:
        # At pi_prox, fixed for the step, as the loss's behaviour weight is: the normaliser and the
        # weights it divides stay at the same policy through every mini-batch.
        w_ST, level = losses.is_weight_at_prox(alg, prox_ST, behav_ST, mask_ST)
        scale = rc.batch_mean_weight(w_ST, keep_ST, level)
        stats["is_norm_factor"] = scale
    return (pv.flat(keep_ST) if alg.rollout_rs else None), scale, stats


def otb_is_weights(step: StepBatch, prox_N: torch.Tensor, alg: AlgorithmConfig) -> torch.Tensor:
    """algorithm.otb_is_weights: the loss's truncated behaviour IS weight of each token at pi_prox,
    on the step's grid (what the optimal token baseline scales each token's energy by, squared)."""
    pv = step.policy
    mask_ST = pv.mask()
    w_ST, _ = losses.is_weight_at_prox(alg, pv.grid(prox_N), pv.grid(step.behav_N.float()), mask_ST)
    return w_ST * mask_ST


def batch_targets(model: nn.Module, step: StepBatch, plan: StepPlan, cfg: Config, rank: int = 0,
                  ref_N: torch.Tensor | None = None, kl_coef: float = 0.0, values_N: torch.Tensor | None = None,
                  pad_id: int = 0) -> Targets:
    """Proximal log-probs (when needed), shaped rewards, advantages (algorithm.advantage, from the
    registry in asyncrl/algorithms/advantages.py), for GAE the returns, and the rollout corrections.

    With kl_in=reward the penalty kl_coef * KL(pi_prox || pi_ref) is a per-token reward. GAE runs
    over completion tokens with the (shaped) reward on each sequence's last token and the critic's
    `values_N` of the behaviour batch; its advantages are whitened over every valid token of the step
    (as verl and OpenRLHF do), returns = advantages before whitening + values. Rejection sampling and
    IS normalisation need pi_prox of the whole step before the first update, so they add the no-grad
    proximal pass when the step has a single update. Everything here runs over the policy's tokens
    alone (`step.policy`: observation tokens of episodes left out, so returns cross them). algorithm.pf_ppo
    weighs every loss term of each sample (`pf_ppo_weights`); with a reference and pi_prox computed ahead, `stats["kl"]` is
    KL(pi_prox || pi_ref), the adaptive controller's statistic.
    """
    alg = cfg.algorithm
    prox = sum_pi2 = None
    kl_reward = ref_N is not None and alg.kl_in == "reward"
    if ADVANTAGES.static_meta(alg.advantage).get("needs_sum_pi2", False):
        prox, sum_pi2 = logprobs_sum_pi2_N(model, step, rank_micro_batches(plan, rank), cfg, pad_id)
    elif plan.num_updates > 1 or kl_reward or alg.rollout_rs or alg.is_normalize:
        prox = logprobs_N(model, step, rank_micro_batches(plan, rank), cfg, pad_id)
    pv = step.policy
    mask_ST = pv.mask()
    kl_ST = kl_coef * pv.grid(kl_fns.kl_estimate(prox, ref_N, alg.kl_estimator)) if kl_reward else None
    rewards_S = shaped_rewards(step, alg, cfg.generator.max_tokens)
    meta = ADVANTAGES.static_meta(alg.advantage)
    critic = meta.get("critic", False)
    if critic:
        assert values_N is not None, f"advantage={alg.advantage} needs the critic's values of the batch"
    elif meta.get("greedy_baseline", False):
        # The learner's quarantine refuses groups without a baseline (schema.validate_for_run).
        assert step.baselines_G is not None, f"advantage={alg.advantage} needs every group's greedy baseline"
        assert step.group_size > 0, "greedy-baseline advantages need equal-sized groups"
    else:
        assert step.group_size > 1, "group advantages need equal-sized groups of at least two samples"
    # Every rank holds the whole step, so group baselines and batch-wide whitening need no collective.
    x = adv_fns.AdvantageInputs(rewards_S.view(-1, 1 if critic else step.group_size), mask_ST, alg, kl_ST,
                                pv.grid(values_N) if values_N is not None else None,
                                logp_BT=pv.grid(prox) if sum_pi2 is not None else None,
                                sum_pi2_BT=pv.grid(sum_pi2) if sum_pi2 is not None else None,
                                baselines_G=step.baselines_G,
                                is_weights_BT=otb_is_weights(step, prox, alg) if alg.otb_is_weights else None)
    adv_ST, returns_ST = adv_fns.estimate(x)
    keep, scale, stats = rollout_correction(step, prox, alg) if (alg.rollout_rs or alg.is_normalize) else (None, None, {})
    weights = pf_ppo_token_weights(step, rewards_S, keep, alg) if alg.pf_ppo != "none" else (None, None)
    if ref_N is not None and prox is not None:
        # The adaptive KL controller's statistic, KL(pi_prox || pi_ref) over the tokens the loss
        # trains, measured at pi_prox (as verl measures it at the old policy), not after earlier
        # mini-batches' updates. With one update per step the learner's first pass measures the same.
        kept_ST = mask_ST if keep is None else pv.grid(keep)
        kl_at_prox_ST = pv.grid(kl_fns.kl_estimate(prox, ref_N, alg.kl_estimator))
        stats["kl"] = (kl_at_prox_ST * kept_ST).sum() / kept_ST.sum().clamp(min=1)
    return Targets(pv.flat(adv_ST), prox, ref_N, pv.flat(returns_ST) if returns_ST is not None else None,
                   values_N if critic else None, keep, scale, stats, *weights)


def pf_ppo_token_weights(step: StepBatch, rewards_S: torch.Tensor, keep_N: torch.Tensor | None,
                         alg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """algorithm.pf_ppo: each token's sequence weight (N floats) for the policy loss's aggregation and
    for critic_aggregation. The weights read `rewards_S`, the reward after DAPO's overlong penalty
    (verl's scores); a weighted term stands for verl's resampled batch, which repeats or drops a
    sample with all its terms (`adv_fns.pf_ppo_loss_weights` says what is exact)."""
    w_S = adv_fns.pf_ppo_weights(rewards_S.double(), alg.pf_ppo, alg.pf_ppo_pow)
    counted_N = step.mask_N.double() if keep_N is None else step.mask_N.double() * keep_N.double()
    tokens_S = torch.zeros_like(w_S).index_add_(0, step.seq_of_N, counted_N)
    return tuple(adv_fns.pf_ppo_loss_weights(w_S, tokens_S, agg)[step.seq_of_N].float()
                 for agg in (alg.aggregation, alg.critic_aggregation))


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm, same result) without DTensor dispatch per gradient:
    FSDP2 shards every gradient along dim 0, so each element lives on exactly one rank; the norm is
    one foreach over the local shards plus one all-reduce of the squared sum. Anything else
    (replicated placements, gradients on the CPU) goes through torch's function."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    dts = [g for g in grads if isinstance(g, DTensor)]
    mesh = dts[0].device_mesh if dts else None
    plain_ok = len(dts) == 0 and len({g.device for g in grads}) == 1
    # The all-reduce runs on the mesh's device type: gradients offloaded elsewhere take torch's path.
    sharded_ok = (len(dts) == len(grads) and mesh.ndim == 1 and all(g.device_mesh == mesh for g in dts)
                  and all(isinstance(pl, Shard) and pl.dim == 0 for g in dts for pl in g.placements)
                  and len({g.device for g in dts}) == 1 and grads[0].device.type == mesh.device_type)
    if not (plain_ok or sharded_ok):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    local = [g.to_local() for g in dts] if dts else grads
    sq = torch.stack(torch_private.foreach_norm(local, 2.0)).float().pow(2).sum()
    if dts and mesh.size() > 1:
        dist.all_reduce(sq, group=mesh.get_group())
    total = sq.sqrt()
    torch_private.foreach_mul_(local, (max_norm / (total + 1e-6)).clamp(max=1.0).to(local[0].dtype))
    return total


class _Stats:
    """Token-weighted sums of the loss statistics over micro-batches (maxima for `*_max`), kept on
    the device until one copy at the end."""

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}
        self.tokens = 0

    def add(self, st: dict, n: int) -> None:
        if n == 0:
            return
        self.tokens += n
        for k, v in st.items():
            v = v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v))
            if k.endswith("_max"):
                self.maxes[k] = torch.maximum(self.maxes[k], v) if k in self.maxes else v
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * n


def kept_counts(step: StepBatch, mbatch, kept_S: torch.Tensor | list[float] | None) -> tuple[int, int]:
    """The mini-batch's loss normalisers (tokens, sequences on all ranks) after rejection sampling:
    rejected tokens leave the token count, and a sequence with none of its tokens kept leaves the
    sequence count (an empty completion stays, as without rejection). `kept_S` as a list (copied
    from the device once a step) costs no device sync per mini-batch."""
    if kept_S is None:
        return mbatch.num_tokens, mbatch.num_seqs
    seqs = [s for rank_micro in mbatch.micro for micro in rank_micro for s in micro]
    if isinstance(kept_S, list):
        kept = [kept_S[s] for s in seqs]
    else:
        kept = kept_S[seqs].tolist() if seqs else []
    policy_len = step.policy_len
    dropped = sum(1 for s, k in zip(seqs, kept, strict=True) if policy_len[s] > 0 and k == 0)
    return int(round(sum(kept))), mbatch.num_seqs - dropped


class _SampledStats:
    """First-epoch sums over valid tokens of the behaviour IS weight pi_theta / mu and of the exact and
    sampled entropies, kept on the device (the defaults of the loss's own statistics)."""

    def __init__(self, device: torch.device):
        self.w_sum = self.w_sq = self.capped = self.neg_logp = self.ent_sum = torch.zeros((), device=device)
        self.w_max = torch.full((), float("-inf"), device=device)

    def add(self, logp_bT: torch.Tensor, behav_bT: torch.Tensor, ent_bT: torch.Tensor, valid_bT: torch.Tensor,
            is_cap: float) -> None:
        # Masked by `where`, not by boolean indexing: indexing asks the device how many tokens are
        # valid, a sync per micro-batch that leaves the GPU idle while the host waits.
        m = valid_bT.bool()
        w = torch.exp(logp_bT.detach() - behav_bT)
        w0 = torch.where(m, w, 0.0)
        self.w_sum, self.w_sq = self.w_sum + w0.sum(), self.w_sq + (w0**2).sum()
        self.w_max = torch.maximum(self.w_max, torch.where(m, w, float("-inf")).max())
        self.capped = self.capped + ((w > is_cap) & m).sum()
        # Monte-Carlo entropy estimate from the sampled tokens: -E[log pi(a)].
        self.neg_logp = self.neg_logp - torch.where(m, logp_bT.detach(), 0.0).sum()
        self.ent_sum = self.ent_sum + torch.where(m, ent_bT.detach(), 0.0).sum()

    def fill(self, st: dict, n: int) -> None:
        """Means over `n` tokens into `st`, where the loss did not report its own."""
        st.setdefault("entropy", self.ent_sum / n)
        st.setdefault("entropy_sampled", self.neg_logp / n)
        st.setdefault("is_weight_mean", self.w_sum / n)
        st.setdefault("is_weight_max", self.w_max)
        st["ess"] = self.w_sum**2 / (n * self.w_sq).clamp(min=1e-12)
        st["is_capped_frac"] = self.capped / n


def kept_per_sequence(step: StepBatch, keep_N: torch.Tensor | None) -> torch.Tensor | None:
    """The number of each sequence's tokens rejection sampling kept (S floats), None without it."""
    if keep_N is None:
        return None
    return torch.zeros(step.num_seqs, device=step.device).index_add_(0, step.seq_of_N, keep_N.float() * step.mask_N)


@dataclass
class _MicroLoss:
    """One micro-batch's share of its mini-batch loss, and what the first epoch's statistics read."""

    loss: torch.Tensor
    stats: dict
    logp_bT: torch.Tensor
    ent_bT: torch.Tensor | None
    behav_bT: torch.Tensor
    valid_bT: torch.Tensor


def _micro_loss(model: nn.Module, mb: MicroBatch, step: StepBatch, targets: Targets, cfg: Config, agg, with_entropy: bool,
                kl_coef: float) -> _MicroLoss:
    """algorithm.loss on one micro-batch, divided by the batch-mean IS weight with is_normalize, on the
    kept tokens, + kl_coef * KL (kl_in=loss) - entropy_coef * exact entropy, each aggregated by `agg`."""
    alg = cfg.algorithm
    out = micro_logprobs(model, mb, cfg.generator.temperature, int(cfg.learner.keep_logits_gb * 2**30),
                         with_entropy=with_entropy)
    logp, ent = (mb.grid(out[0]), mb.grid(out[1])) if with_entropy else (mb.grid(out), None)

    def pick(flat_N):
        return mb.grid(flat_N.index_select(0, mb.flat_N))

    valid, behav, adv = mb.mask_bT, pick(step.behav_N), pick(targets.adv_N)
    mask = valid if targets.keep_N is None else valid * pick(targets.keep_N)
    # With a single update per step the proximal policy is the current one, exactly.
    prox = logp.detach() if targets.prox_N is None else pick(targets.prox_N)
    loss_bT, st = losses.policy_loss(losses.LossInputs(logp, prox, behav, adv, mask, alg, valid))
    if targets.is_scale is not None:
        loss_bT = loss_bT / targets.is_scale
    seq_w = None if targets.weight_N is None else pick(targets.weight_N)

    def weighed(x_bT):  # algorithm.pf_ppo: every term of a sequence at its weight, as verl's resampling
        return x_bT if seq_w is None else x_bT * seq_w
    loss = agg(weighed(loss_bT), mask)
    if targets.ref_N is not None:
        kl_bT = kl_fns.kl_estimate(logp, pick(targets.ref_N), alg.kl_estimator)
        st["kl"] = (kl_bT.detach() * mask).sum() / mask.sum().clamp(min=1)
        if alg.kl_in == "loss":
            loss = loss + kl_coef * agg(weighed(kl_bT), mask)
    if alg.entropy_coef > 0:
        loss = loss - alg.entropy_coef * agg(weighed(ent), mask)
    return _MicroLoss(loss, st, logp, ent, behav, valid)


def _optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                    scheduler=None) -> torch.Tensor:
    """Clip, step, clear the gradients, step the schedule; returns the norm before clipping."""
    grad_norm = clip_grad_norm(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    return grad_norm


def _step_stats(stats: _Stats, sampled: _SampledStats, targets: Targets, loss_parts: list, grad_norm,
                device: torch.device) -> dict[str, float]:
    """The step's statistics as floats: token-weighted means and maxima of the first epoch, the
    whole-step values, the mean mini-batch loss and the first gradient norm."""
    n = max(stats.tokens, 1)
    st = {k: v / n for k, v in stats.sums.items()} | stats.maxes
    if stats.tokens:
        sampled.fill(st, n)
    st.setdefault("ratio_mean", 1.0)
    st.setdefault("ratio_max", 1.0)
    st["clip_frac"] = st.get("clip_frac", st.get("clip_frac_low", 0.0) + st.get("clip_frac_high", 0.0))
    st.update(targets.stats)  # whole-step values, the same on every rank (`kl` at pi_prox included)
    st.update(loss=torch.stack(loss_parts).mean(), grad_norm=grad_norm.full_tensor()
              if hasattr(grad_norm, "full_tensor") else grad_norm)
    # One device-to-host copy for every statistic (they are 0-dim tensors or floats until here).
    names = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([st[k].detach().float().reshape(()).to(device) for k in names]).tolist() if names else []
    copied = dict(zip(names, values, strict=True))
    return {k: copied[k] if k in copied else float(v) for k, v in st.items()}


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, step: StepBatch, plan: StepPlan, cfg: Config,
                  targets: Targets, rank: int = 0, world: int = 1, pad_id: int = 0, kl_coef: float = 0.0,
                  scheduler=None) -> dict[str, float]:
    """Every update of `plan` (epochs x mini-batches, one optimizer step each) on `step`.

    Each micro-batch's loss is its share of the mini-batch loss: summed over its tokens (token_mean)
    or sequences (seq_mean_*) and divided by the mini-batch's count on all ranks, times the world
    size, since FSDP averages gradients over ranks; the accumulated gradient is the exact mini-batch
    gradient at any world size and any split into micro-batches. The loss is algorithm.loss
    (asyncrl/algorithms/losses.py), divided by the batch-mean IS weight with is_normalize, on the tokens
    rejection sampling kept, + kl_coef * KL (kl_in=loss) - entropy_coef * exact entropy, each term
    aggregated by algorithm.aggregation. Returns this rank's statistics over the first epoch
    (token-weighted means, maxima), `loss` as this rank's part of the mean mini-batch loss (the
    ranks' parts add up to it), the first update's gradient norm and the step's correction statistics.
    """
    alg, lc = cfg.algorithm, cfg.learner
    norm_tokens = alg.loss_norm_tokens or cfg.generator.max_tokens
    kept_S = kept_per_sequence(step, targets.keep_N)
    kept_S = kept_S.tolist() if kept_S is not None else None  # one copy a step, not one per mini-batch
    stats, sampled, loss_parts, grad_norms = _Stats(), _SampledStats(step.device), [], []
    model.train()
    for epoch, minibatches in enumerate(plan.epochs):
        # The exact entropy comes from the same chunks as the log-probs: for the metrics in the first
        # epoch, and in every epoch when the loss has an entropy bonus.
        with_entropy = epoch == 0 or alg.entropy_coef > 0
        for mbatch in minibatches:
            part = torch.zeros((), device=step.device)
            num_tokens, num_seqs = kept_counts(step, mbatch, kept_S)

            def agg(x_bT, mask_bT, num_tokens=num_tokens, num_seqs=num_seqs):
                return aggregate_normalised(x_bT, mask_bT, alg.aggregation, num_tokens, num_seqs, norm_tokens)

            for seqs in mbatch.micro[rank]:
                mb = micro_batch(step, seqs, lc.packing, pad_id)
                micro = _micro_loss(model, mb, step, targets, cfg, agg, with_entropy, kl_coef)
                (micro.loss * world).backward()
                part += micro.loss.detach()
                if epoch == 0 and mb.num_tokens:
                    stats.add(micro.stats, mb.num_tokens)
                    sampled.add(micro.logp_bT, micro.behav_bT, micro.ent_bT, micro.valid_bT, alg.is_cap)
            grad_norms.append(_optimizer_step(model, optimizer, lc.max_grad_norm, scheduler))
            if epoch == 0:
                loss_parts.append(part)
    return _step_stats(stats, sampled, targets, loss_parts, grad_norms[0], step.device)
