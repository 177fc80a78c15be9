"""The learner's optimisation of one batch, free of Redis and of the learner's own collectives.

`Learner.train_step` builds the batch and reduces the stats across ranks around `policy_update`;
`benchmarks/learner_throughput.py` times exactly this function. Under FSDP2 the model's own hooks
(all-gather, reduce-scatter) and `clip_grad_norm_`'s DTensor reduction still run inside it.

One update, top to bottom: shape rewards (overlong penalty, KL-in-reward) -> advantages
(algorithm.advantage; `batch_targets`) -> log-probs under pi_theta (chunked) -> per-token loss
(algorithm.loss) -> + KL-in-loss -> aggregate -> backward -> clip -> step. With advantage=gae the
learner passes the critic's old values to `batch_targets` and fits the critic to the returns it gives
(learners/critic.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl import advantages as adv_fns
from asyncrl import losses
from asyncrl.algorithms import aggregate
from learners.logprobs import sequence_logprobs

if TYPE_CHECKING:
    from asyncrl.config import AlgorithmConfig, Config
    from learners.batch import Batch


def reference_logprobs(ref_model: nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """Log-probs of the batch's tokens under a frozen model (no graph kept), B x T."""
    ref_model.eval()
    with torch.no_grad():
        return sequence_logprobs(ref_model, batch.input_ids_BL, batch.attention_mask_BL, temperature,
                                 rows_BT=batch.loss_rows)


def shaped_rewards(batch: Batch, alg: AlgorithmConfig, max_tokens: int, kl_seq_B: torch.Tensor | None,
                   kl_coef: float) -> torch.Tensor:
    """Rewards after DAPO overlong shaping and, with kl_in=reward, minus kl_coef * sequence KL."""
    r_B = batch.rewards_B.to(torch.float32).clone()
    if alg.overlong_buffer > 0:
        # Linear penalty over the last `overlong_buffer` tokens before max_tokens (DAPO soft punishment).
        length_B = batch.loss_mask_BT.sum(dim=1)
        start = max_tokens - alg.overlong_buffer
        r_B -= alg.overlong_penalty * ((length_B - start).clamp(min=0) / alg.overlong_buffer).clamp(max=1.0)
    if kl_seq_B is not None and alg.kl_in == "reward":
        r_B -= kl_coef * kl_seq_B
    return r_B


def data_parallel_sum() -> adv_fns.AllReduce | None:
    """An in-place sum over the learner's ranks (whitening's batch moments), None at world size 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.all_reduce
    return None


def advantages_BT(batch: Batch, rewards_B: torch.Tensor, alg: AlgorithmConfig,
                  all_reduce: adv_fns.AllReduce | None = None) -> torch.Tensor:
    """Group / batch-baseline advantages, B x T; GAE needs the critic's values (`batch_targets`).
    Each rank holds whole groups, so group baselines are local; the batch-wide whitening of the
    REINFORCE++ pair sums its moments with `all_reduce`."""
    assert alg.advantage != "gae", "GAE advantages come from batch_targets(..., values_BT=...)"
    mask = batch.loss_mask_BT
    n = batch.group_size
    assert n > 1, "group advantages need equal-sized groups of at least two samples"
    r_GN = rewards_B.view(-1, n)
    if alg.advantage in ("grpo", "dr_grpo"):
        return adv_fns.grpo(r_GN, norm_std=alg.advantage == "grpo").reshape(-1, 1) * mask
    if alg.advantage == "rloo":
        return adv_fns.rloo(r_GN).reshape(-1, 1) * mask
    if alg.advantage == "reinforce_pp":
        return adv_fns.reinforce_pp(rewards_B, mask, all_reduce=all_reduce)
    if alg.advantage == "reinforce_pp_baseline":
        return adv_fns.reinforce_pp_baseline(r_GN, mask, all_reduce=all_reduce)
    raise AssertionError(alg.advantage)


@dataclass
class Targets:
    """What every update of one batch is fitted to, fixed before the first update."""

    adv_BT: torch.Tensor
    prox_BT: torch.Tensor | None  # log pi_prox, when computed ahead (several updates or KL-in-reward)
    returns_BT: torch.Tensor | None = None  # advantage=gae: the critic's regression targets


def batch_targets(model: nn.Module, batch: Batch, cfg: Config, ref_logp_BT: torch.Tensor | None = None,
                  kl_coef: float = 0.0, values_BT: torch.Tensor | None = None) -> Targets:
    """Proximal log-probs (when needed), shaped rewards, advantages and, for GAE, returns.

    GAE runs over completion tokens with the (shaped) reward on each sequence's last token and the
    critic's `values_BT` of the behaviour batch; advantages are then whitened over the valid tokens of
    the whole batch across all ranks (as verl and OpenRLHF do), returns = advantages before whitening
    + values.
    """
    alg = cfg.algorithm
    num_updates = cfg.learner.ppo_epochs * cfg.learner.minibatches
    mask = batch.loss_mask_BT
    model.train()
    prox = None
    if num_updates > 1 or (ref_logp_BT is not None and alg.kl_in == "reward"):
        with torch.no_grad():
            prox = sequence_logprobs(model, batch.input_ids_BL, batch.attention_mask_BL, cfg.generator.temperature,
                                     rows_BT=batch.loss_rows)
    kl_seq_B = None
    if ref_logp_BT is not None and alg.kl_in == "reward":
        kl_seq_B = (losses.kl_estimate(prox, ref_logp_BT, alg.kl_estimator) * mask).sum(dim=1)
    rewards_B = shaped_rewards(batch, alg, cfg.generator.max_tokens, kl_seq_B, kl_coef)
    if alg.advantage == "gae":
        assert values_BT is not None, "advantage=gae needs the critic's values of the batch"
        adv, returns = adv_fns.gae(rewards_B, values_BT, mask, alg.gamma, alg.lam)
        return Targets(adv_fns.whiten(adv, mask, all_reduce=data_parallel_sum()), prox, returns)
    return Targets(advantages_BT(batch, rewards_B, alg, data_parallel_sum()), prox)


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


def token_loss(alg: AlgorithmConfig, logp, prox, batch: Batch, adv):
    """Per-token loss [B, T] and stats for algorithm.loss (see asyncrl/losses.py)."""
    behav, mask = batch.behav_logp_BT, batch.loss_mask_BT
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


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: Config,
                  loss_scale: float, ref_logp_BT: torch.Tensor | None = None, kl_coef: float = 0.0,
                  scheduler=None, targets: Targets | None = None) -> dict[str, float]:
    """`learner.ppo_epochs * learner.minibatches` updates of `model` on `batch`.

    `loss_scale` multiplies the loss before backward: the rank's share of the global token count, so
    that FSDP's gradient mean over ranks is the exact global token mean. Returns this rank's stats of
    the first update (loss, ratio / IS-weight stats, KL, grad norm before clipping). `targets`: from
    `batch_targets` (the learner's GAE path); computed here when not given.
    """
    alg = cfg.algorithm
    temperature = cfg.generator.temperature
    num_updates = cfg.learner.ppo_epochs * cfg.learner.minibatches
    mask = batch.loss_mask_BT

    def logp_BT() -> torch.Tensor:
        return sequence_logprobs(model, batch.input_ids_BL, batch.attention_mask_BL, temperature,
                                 rows_BT=batch.loss_rows, keep_logits_bytes=int(cfg.learner.keep_logits_gb * 2**30))

    def apply(loss: torch.Tensor) -> torch.Tensor:
        (loss * loss_scale).backward()
        grad_norm = clip_grad_norm(model.parameters(), cfg.learner.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        return grad_norm

    if targets is None:
        targets = batch_targets(model, batch, cfg, ref_logp_BT, kl_coef)
    model.train()
    prox, adv = targets.prox_BT, targets.adv_BT

    def full_loss(logp, prox_logp):
        loss_BT, st = token_loss(alg, logp, prox_logp, batch, adv)
        loss = aggregate(loss_BT, mask, alg.aggregation)
        if ref_logp_BT is not None:
            kl_BT = losses.kl_estimate(logp, ref_logp_BT, alg.kl_estimator)
            st["kl"] = (kl_BT.detach() * mask).sum() / mask.sum().clamp(min=1)
            if alg.kl_in == "loss":
                loss = loss + kl_coef * aggregate(kl_BT, mask, alg.aggregation)
        return loss, st

    logp = logp_BT()
    # With a single update per batch the proximal policy is the current one, exactly.
    loss, st = full_loss(logp, logp.detach() if prox is None else prox)
    grad_norm = apply(loss)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    for _ in range(num_updates - 1):
        apply(full_loss(logp_BT(), prox)[0])
    with torch.no_grad():
        m = mask.bool()
        w = torch.exp(logp.detach() - batch.behav_logp_BT)[m]
        # Monte-Carlo entropy estimate from the sampled tokens (the full distribution is never
        # materialised): -E[log pi(a)].
        st.setdefault("entropy", float(-logp.detach()[m].mean()) if m.any() else 0.0)
        st.setdefault("is_weight_mean", float(w.mean()) if w.numel() else 1.0)
        st.setdefault("is_weight_max", float(w.max()) if w.numel() else 1.0)
        st["ess"] = float(w.sum() ** 2 / (w.numel() * (w**2).sum()).clamp(min=1e-12)) if w.numel() else 1.0
        st["is_capped_frac"] = float((w > alg.is_cap).float().mean()) if w.numel() else 0.0
        st.setdefault("ratio_mean", 1.0)
        st.setdefault("ratio_max", 1.0)
        st["clip_frac"] = st.get("clip_frac", st.get("clip_frac_low", 0.0) + st.get("clip_frac_high", 0.0))
    # One device-to-host copy for every statistic (they are 0-dim tensors or floats until here).
    st.update(loss=loss.detach(), grad_norm=grad_norm)
    names = [k for k, v in st.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([st[k].detach().float().reshape(()).to(mask.device) for k in names]).tolist() if names else []
    return {**{k: float(v) for k, v in st.items()}, **dict(zip(names, values, strict=True))}
