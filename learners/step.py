"""The learner's optimisation of one batch, free of Redis and of the learner's own collectives.

`Learner.train_step` builds the batch and reduces the stats across ranks around `policy_update`;
`benchmarks/learner_throughput.py` times exactly this function. Under FSDP2 the model's own hooks
(all-gather, reduce-scatter) and `clip_grad_norm_`'s DTensor reduction still run inside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl.algorithms import decoupled_ppo_loss
from learners.logprobs import sequence_logprobs

if TYPE_CHECKING:
    from asyncrl.config import Config
    from learners.batch import Batch


def reference_logprobs(ref_model: nn.Module, batch: Batch, temperature: float) -> torch.Tensor:
    """Log-probs of the batch's tokens under a frozen model (no graph kept), B x T."""
    ref_model.eval()
    with torch.no_grad():
        return sequence_logprobs(ref_model, batch.input_ids_BL, batch.attention_mask_BL, temperature)


def policy_update(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: Config,
                  loss_scale: float) -> dict[str, float]:
    """`learner.ppo_epochs * learner.minibatches` decoupled-PPO updates of `model` on `batch`.

    `loss_scale` multiplies the loss before backward: the rank's share of the global token count, so
    that FSDP's gradient mean over ranks is the exact global token mean. Returns this rank's stats of
    the first update (loss, ratio / IS-weight stats, grad norm before clipping).
    """
    alg = cfg.algorithm
    temperature = cfg.generator.temperature
    num_updates = cfg.learner.ppo_epochs * cfg.learner.minibatches

    def logp_BT() -> torch.Tensor:
        return sequence_logprobs(model, batch.input_ids_BL, batch.attention_mask_BL, temperature)

    def loss_of(logp, prox_logp):
        return decoupled_ppo_loss(logp, prox_logp, batch.behav_logp_BT, batch.adv_B, batch.loss_mask_BT,
                                  alg.clip_low, alg.clip_high, alg.is_cap, alg.aggregation)

    def apply(loss: torch.Tensor) -> torch.Tensor:
        (loss * loss_scale).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    model.train()
    prox = None
    if num_updates > 1:
        with torch.no_grad():
            prox = logp_BT()
    logp = logp_BT()
    # With a single update per batch the proximal policy is the current one, exactly.
    loss, ls = loss_of(logp, logp.detach() if prox is None else prox)
    grad_norm = apply(loss)
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    # Further PPO epochs / minibatches re-use `prox`; kept simple here: one pass per update.
    for _ in range(num_updates - 1):
        apply(loss_of(logp_BT(), prox)[0])
    return {"loss": float(loss.detach()), "ratio_mean": ls.ratio_mean, "ratio_max": ls.ratio_max,
            "is_weight_mean": ls.is_weight_mean, "is_weight_max": ls.is_weight_max, "ess": ls.ess,
            "clip_frac": ls.clip_frac, "is_capped_frac": ls.is_capped_frac, "grad_norm": float(grad_norm)}
