"""One learner step on every rank: the plan, the reference and critic passes, the updates
(learners/step.py), and the step's statistics reduced across ranks; the kernel warm-up step.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from asyncrl.protocol import schema
from learners import packing
from learners.batch import build_step
from learners.critic import critic_update, old_values
from learners.flops import step_flops
from learners.setup import Parts
from learners.step import batch_targets, logprobs_N, policy_update, rank_micro_batches
from learners.warmup import WARMUP_PROMPT_TOKENS, frozen_training_state, synthetic_groups

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had

# Statistics that are the whole step's already (grad norms, the critic's), and the losses, which
# each rank holds a part of (summed).
GLOBAL_STATS = ("grad_norm", "value_grad_norm", "critic_lr", "value_explained_var", "value_mean", "returns_mean")
SUMMED_STATS = ("loss", "value_loss")


def train_step(parts: Parts, groups: list[schema.TrajectoryGroup], step_index: int) -> dict:
    """One learner step on all of the step's groups (every rank holds them): the plan
    (learners/packing.py) gives each rank its share of every mini-batch in micro-batches."""
    cfg, lc = parts.cfg, parts.cfg.learner
    t0 = time.perf_counter()
    if parts.cuda:
        torch.cuda.reset_peak_memory_stats(parts.device)
    step = build_step(groups, device=parts.device)
    # The loss normalisers count the policy's tokens (an episode's observations are not trained on).
    plan = packing.plan_step(step.group_sizes, step.lengths, step.policy_len, world=parts.world,
                             minibatches=lc.minibatches, epochs=lc.ppo_epochs, budget=parts.micro_batch_tokens,
                             packed=lc.packing, seed=cfg.run.seed * 1_000_003 + step_index)
    micro = rank_micro_batches(plan, parts.rank)
    ref_logp = None
    if parts.ref_model is not None:
        with parts.reference():
            ref_logp = logprobs_N(parts.ref_model, step, micro, cfg, parts.pad_id)
    lr = parts.optimizer.param_groups[0]["lr"]  # the rate this step's (first) update uses
    # GAE: the critic scores the behaviour batch before any update; its values give the
    # advantages (policy) and the returns (critic), both fixed for the step's updates.
    values = None
    if parts.critic is not None:
        values = old_values(parts.critic, step, plan, cfg, parts.rank, parts.pad_id)
    targets = batch_targets(parts.model, step, plan, cfg, parts.rank, ref_logp, parts.kl_ctl.value, values,
                            parts.pad_id)
    st = policy_update(parts.model, parts.optimizer, step, plan, cfg, targets, parts.rank, parts.world,
                       parts.pad_id, kl_coef=parts.kl_ctl.value, scheduler=parts.scheduler)
    if parts.critic is not None:
        st["critic_lr"] = parts.critic_optimizer.param_groups[0]["lr"]
        st.update(critic_update(parts.critic, parts.critic_optimizer, step, plan, values, targets.returns_N, cfg,
                                parts.rank, parts.world, parts.pad_id, scheduler=parts.critic_scheduler,
                                keep_N=targets.keep_N,  # tokens rejection sampling dropped train no value
                                weight_N=targets.value_weight_N))
    local_tokens = sum(step.policy_len[s] for seqs in micro for s in seqs)
    out = _across_ranks(st, local_tokens * parts.world / max(step.num_policy_tokens, 1), parts)
    if "kl" in out:
        out["kl_coef"] = parts.kl_ctl.value
        out["ref_checksum"] = parts.ref_checksum
        parts.kl_ctl.update(out["kl"], step.num_seqs)  # the controller's horizon counts samples
    out["lr"] = lr
    out.update({k: st[k] for k in GLOBAL_STATS if k in st})
    step_s = time.perf_counter() - t0  # the statistics' copy above waited for the device's last kernel
    real = sum(step.lengths)
    # Per device: the step's model FLOPs over all ranks, its compute time and the device's peak.
    flops = step_flops(parts.policy_flops, step.lengths, step.num_tokens, epochs=lc.ppo_epochs,
                       reference=ref_logp is not None, proximal=targets.prox_N is not None, critic=parts.critic_flops)
    per_device = flops / max(step_s, 1e-9) / parts.world
    out.update(tflops=per_device / 1e12, mfu=per_device / parts.peak_flops)
    processed = plan.processed_tokens(step.lengths, lc.packing)
    out.update(updates=float(plan.num_updates), micro_batches=float(plan.micro_batches(parts.rank)),
               pad_frac=1.0 - real * lc.ppo_epochs / max(processed, 1), real_tokens_per_s=real / max(step_s, 1e-9),
               micro_batch_tokens=float(parts.micro_batch_tokens))
    if parts.cuda:
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(parts.device) / 2**30
    return {**out, "tokens": float(step.num_policy_tokens), "step_s": step_s}


def _across_ranks(st: dict, share: float, parts: Parts) -> dict:
    """Across ranks: token-weighted means (each rank's stat times its token `share`), maxima for
    *_max, sums for the losses (each rank holds its part). Grad norms and whole-step statistics are
    global already, and left out."""
    world = parts.world
    names = sorted(k for k in st if k not in GLOBAL_STATS)
    weight = {k: (1.0 if k in SUMMED_STATS else share / world) for k in names}
    means = torch.tensor([st[k] * weight[k] for k in names if not k.endswith("_max")], device=parts.device)
    maxes = torch.tensor([st[k] for k in names if k.endswith("_max")], device=parts.device)
    if world > 1:
        dist.all_reduce(means)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    out = dict(zip([k for k in names if not k.endswith("_max")], means.tolist(), strict=True))
    out.update(zip([k for k in names if k.endswith("_max")], maxes.tolist(), strict=True))
    return out


def kernel_warmup(parts: Parts, resumed: bool, step_index: int) -> None:
    """learner.kernel_warmup: one step on synthetic groups (learners/warmup.py); the weights, the
    schedules and the KL controller are unchanged by it, the optimizers as fresh as before."""
    cfg, optimizers = parts.cfg, parts.optimizers()
    if cfg.learner.kernel_warmup == "off" or (cfg.learner.kernel_warmup == "auto" and not parts.cuda):
        return
    if resumed or step_index > 0 or any(opt.state for opt, _ in optimizers):
        return  # resumed: the optimizer's state is the run's own, and the kernels are the first step's cost
    t0 = time.perf_counter()
    g = cfg.generator
    prompt_tokens = max(1, min(WARMUP_PROMPT_TOKENS, g.max_model_len - g.max_tokens))
    groups = synthetic_groups(cfg.learner.batch_groups, g.n, prompt_tokens, g.max_tokens,
                              parts.model.config.vocab_size, cfg.run.seed)
    with frozen_training_state([o for o, _ in optimizers], [s for _, s in optimizers], parts.kl_ctl):
        train_step(parts, groups, step_index)
    if parts.cuda:
        torch.cuda.synchronize(parts.device)
    if parts.rank == 0:
        log.info("kernel warm-up: one step on synthetic groups in %.2fs (learning rate 0, optimizer state "
                 "emptied after it)", time.perf_counter() - t0)
