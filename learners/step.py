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

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl import advantages as adv_fns
from asyncrl import losses
from asyncrl.algorithms import aggregate_normalised
from learners.batch import StepBatch, micro_batch
from learners.logprobs import micro_logprobs

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig, Config
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


def forward_N(fn, step: StepBatch, micro: list[list[int]], packed: bool, pad_id: int) -> torch.Tensor:
    """`fn(micro_batch)` (a flat tensor of its completion tokens' values) over this rank's
    micro-batches, without grad, gathered into the step's N positions and summed over the ranks,
    so every rank holds the values of every sequence."""
    out = torch.zeros(step.num_tokens, dtype=torch.float32, device=step.device)
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


def shaped_rewards(step: StepBatch, alg: AlgorithmConfig, max_tokens: int, kl_seq_S: torch.Tensor | None,
                   kl_coef: float) -> torch.Tensor:
    """Rewards after DAPO overlong shaping and, with kl_in=reward, minus kl_coef * sequence KL."""
    r_S = step.rewards_S.to(torch.float32).clone()
    if alg.overlong_buffer > 0:
        # Linear penalty over the last `overlong_buffer` tokens before max_tokens (DAPO soft punishment).
        length_S = torch.tensor(step.comp_len, dtype=torch.float32, device=r_S.device)
        start = max_tokens - alg.overlong_buffer
        r_S -= alg.overlong_penalty * ((length_S - start).clamp(min=0) / alg.overlong_buffer).clamp(max=1.0)
    if kl_seq_S is not None and alg.kl_in == "reward":
        r_S -= kl_coef * kl_seq_S
    return r_S


def advantages_N(step: StepBatch, rewards_S: torch.Tensor, alg: AlgorithmConfig) -> torch.Tensor:
    """Group / batch-baseline advantages of every completion token, N floats. Every rank holds the
    whole step, so group baselines and the batch-wide whitening of the REINFORCE++ pair are the
    whole step's with no collective."""
    assert alg.advantage != "gae", "GAE advantages come from batch_targets(..., values_N=...)"
    n = step.group_size
    assert n > 1, "group advantages need equal-sized groups of at least two samples"
    r_GN = rewards_S.view(-1, n)
    if alg.advantage in ("grpo", "dr_grpo"):
        return adv_fns.grpo(r_GN, norm_std=alg.advantage == "grpo").reshape(-1)[step.seq_of_N]
    if alg.advantage == "rloo":
        return adv_fns.rloo(r_GN).reshape(-1)[step.seq_of_N]
    mask_ST = step.grid(torch.ones(step.num_tokens, device=step.device))
    if alg.advantage == "reinforce_pp":
        return step.flat(adv_fns.reinforce_pp(rewards_S, mask_ST))
    if alg.advantage == "reinforce_pp_baseline":
        return step.flat(adv_fns.reinforce_pp_baseline(r_GN, mask_ST))
    raise AssertionError(alg.advantage)


@dataclass
class Targets:
    """What every update of one step is fitted to, fixed before the first update; N floats each."""

    adv_N: torch.Tensor
    prox_N: torch.Tensor | None  # log pi_prox, when computed ahead (several updates or KL-in-reward)
    ref_N: torch.Tensor | None = None  # log pi_ref, when a KL term needs it
    returns_N: torch.Tensor | None = None  # advantage=gae: the critic's regression targets
    values_N: torch.Tensor | None = None  # advantage=gae: the critic's values before the step


def batch_targets(model: nn.Module, step: StepBatch, plan: StepPlan, cfg: Config, rank: int = 0,
                  ref_N: torch.Tensor | None = None, kl_coef: float = 0.0, values_N: torch.Tensor | None = None,
                  pad_id: int = 0) -> Targets:
    """Proximal log-probs (when needed), shaped rewards, advantages and, for GAE, returns.

    GAE runs over completion tokens with the (shaped) reward on each sequence's last token and the
    critic's `values_N` of the behaviour batch; advantages are then whitened over every valid token
    of the step (as verl and OpenRLHF do), returns = advantages before whitening + values.
    """
    alg = cfg.algorithm
    prox = None
    if plan.num_updates > 1 or (ref_N is not None and alg.kl_in == "reward"):
        prox = logprobs_N(model, step, rank_micro_batches(plan, rank), cfg, pad_id)
    kl_seq_S = None
    if ref_N is not None and alg.kl_in == "reward":
        kl_N = losses.kl_estimate(prox, ref_N, alg.kl_estimator)
        kl_seq_S = torch.zeros(step.num_seqs, device=step.device).index_add_(0, step.seq_of_N, kl_N)
    rewards_S = shaped_rewards(step, alg, cfg.generator.max_tokens, kl_seq_S, kl_coef)
    if alg.advantage == "gae":
        assert values_N is not None, "advantage=gae needs the critic's values of the batch"
        mask_ST = step.grid(torch.ones(step.num_tokens, device=step.device))
        adv, returns = adv_fns.gae(rewards_S, step.grid(values_N), mask_ST, alg.gamma, alg.lam)
        return Targets(step.flat(adv_fns.whiten(adv, mask_ST)), prox, ref_N, step.flat(returns), values_N)
    return Targets(advantages_N(step, rewards_S, alg), prox, ref_N)


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
    sq = torch.stack(torch._foreach_norm(local, 2.0)).float().pow(2).sum()
    if dts and mesh.size() > 1:
        dist.all_reduce(sq, group=mesh.get_group())
    total = sq.sqrt()
    torch._foreach_mul_(local, (max_norm / (total + 1e-6)).clamp(max=1.0).to(local[0].dtype))
    return total


def token_loss(alg: AlgorithmConfig, logp, prox, behav, adv, mask):
    """Per-token loss [b, T] and stats for algorithm.loss (see asyncrl/losses.py)."""
    dual = alg.dual_clip or None
    if alg.loss == "decoupled_ppo":
        return losses.decoupled_ppo(logp, prox, behav, adv, mask, alg.clip_low, alg.clip_high, alg.is_cap,
                                    alg.is_level, dual)
    if alg.loss == "ppo":  # plain PPO: the behaviour policy is the old policy
        return losses.ppo_clip(logp, behav, adv, mask, alg.clip_low, alg.clip_high, dual)
    if alg.loss == "tis":
        return losses.tis_pg(logp, behav, adv, mask, alg.is_cap)
    if alg.loss == "mis":
        return losses.mis_pg(logp, behav, adv, mask, alg.mis_low, alg.mis_high)
    if alg.loss == "cispo":
        return losses.cispo(logp, behav, adv, mask, alg.clip_low, alg.clip_high)
    if alg.loss == "gspo":
        return losses.gspo(logp, prox, adv, mask, alg.clip_low, alg.clip_high)
    raise AssertionError(alg.loss)


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


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, step: StepBatch, plan: StepPlan, cfg: Config,
                  targets: Targets, rank: int = 0, world: int = 1, pad_id: int = 0, kl_coef: float = 0.0,
                  scheduler=None) -> dict[str, float]:
    """Every update of `plan` (epochs x mini-batches, one optimizer step each) on `step`.

    Each micro-batch's loss is its share of the mini-batch loss: summed over its tokens (token_mean)
    or sequences (seq_mean_*) and divided by the mini-batch's count on all ranks, times the world
    size, since FSDP averages gradients over ranks; the accumulated gradient is the exact mini-batch
    gradient at any world size and any split into micro-batches. Returns this rank's statistics over
    the first epoch (token-weighted means, maxima), `loss` as this rank's part of the mean
    mini-batch loss (the ranks' parts add up to it) and the first update's gradient norm.
    """
    alg, lc = cfg.algorithm, cfg.learner
    temperature = cfg.generator.temperature
    keep = int(lc.keep_logits_gb * 2**30)
    stats, loss_parts, grad_norms = _Stats(), [], []
    w_sum = w_sq = capped = neg_logp = torch.zeros((), device=step.device)
    w_max = torch.full((), float("-inf"), device=step.device)
    model.train()
    for epoch, minibatches in enumerate(plan.epochs):
        for mbatch in minibatches:
            part = torch.zeros((), device=step.device)
            for seqs in mbatch.micro[rank]:
                mb = micro_batch(step, seqs, lc.packing, pad_id)
                logp = mb.grid(micro_logprobs(model, mb, temperature, keep))

                def pick(flat_N, mb=mb):
                    return mb.grid(flat_N.index_select(0, mb.flat_N))

                mask, behav, adv = mb.mask_bT, pick(step.behav_N), pick(targets.adv_N)
                # With a single update per step the proximal policy is the current one, exactly.
                prox = logp.detach() if targets.prox_N is None else pick(targets.prox_N)
                loss_bT, st = token_loss(alg, logp, prox, behav, adv, mask)
                loss = aggregate_normalised(loss_bT, mask, alg.aggregation, mbatch.num_tokens, mbatch.num_seqs)
                if targets.ref_N is not None:
                    kl_bT = losses.kl_estimate(logp, pick(targets.ref_N), alg.kl_estimator)
                    st["kl"] = (kl_bT.detach() * mask).sum() / mask.sum().clamp(min=1)
                    if alg.kl_in == "loss":
                        loss = loss + kl_coef * aggregate_normalised(kl_bT, mask, alg.aggregation, mbatch.num_tokens,
                                                                     mbatch.num_seqs)
                (loss * world).backward()
                part += loss.detach()
                if epoch == 0 and mb.num_tokens:
                    stats.add(st, mb.num_tokens)
                    m = mask.bool()
                    w = torch.exp(logp.detach() - behav)[m]
                    w_sum, w_sq = w_sum + w.sum(), w_sq + (w**2).sum()
                    w_max = torch.maximum(w_max, w.max())
                    capped = capped + (w > alg.is_cap).sum()
                    # Monte-Carlo entropy estimate from the sampled tokens: -E[log pi(a)].
                    neg_logp = neg_logp - logp.detach()[m].sum()
            grad_norms.append(clip_grad_norm(model.parameters(), lc.max_grad_norm))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            if epoch == 0:
                loss_parts.append(part)
    n = max(stats.tokens, 1)
    st = {k: v / n for k, v in stats.sums.items()} | stats.maxes
    if stats.tokens:
        st.setdefault("entropy", neg_logp / n)
        st.setdefault("is_weight_mean", w_sum / n)
        st.setdefault("is_weight_max", w_max)
        st["ess"] = w_sum**2 / (n * w_sq).clamp(min=1e-12)
        st["is_capped_frac"] = capped / n
    st.setdefault("ratio_mean", 1.0)
    st.setdefault("ratio_max", 1.0)
    st["clip_frac"] = st.get("clip_frac", st.get("clip_frac_low", 0.0) + st.get("clip_frac_high", 0.0))
    grad_norm = grad_norms[0]
    st.update(loss=torch.stack(loss_parts).mean(), grad_norm=grad_norm.full_tensor()
              if hasattr(grad_norm, "full_tensor") else grad_norm)
    # One device-to-host copy for every statistic (they are 0-dim tensors or floats until here).
    names = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([st[k].detach().float().reshape(()).to(step.device) for k in names]).tolist() if names else []
    return {**{k: float(v) for k, v in st.items()}, **dict(zip(names, values, strict=True))}
