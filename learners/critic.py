"""The critic for algorithm.advantage=gae: a value model and its PPO value update.

The value model is the decoder of a causal LM (`AutoModel`, e.g. `Qwen2Model` from a
`Qwen2ForCausalLM` checkpoint) with a scalar head, rather than `AutoModelForTokenClassification`:
every causal-LM checkpoint loads as its decoder, while token-classification classes exist only for
some architectures; and it does not hold the unused V x H output projection. Under FSDP2 it is
sharded like the policy (each decoder layer, then the root with embeddings, final norm and head).

Alignment: values_BT[b, j] = V(prefix up to token j), the value of the state in which token j+1 is
sampled, so it lines up with the batch's targets_BT / loss_mask_BT (learners/batch.py); for a
micro-batch, the values at its `rows` are those of its completion tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from learners.batch import micro_batch

if TYPE_CHECKING:
    from asyncrl.config import Config
    from learners.batch import Batch, MicroBatch, StepBatch
    from learners.packing import StepPlan


class ValueModel(nn.Module):
    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Zero head: the first values are 0, so the first advantages are the plain (discounted) returns
        # rather than noise from a random projection.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None,
                position_ids_BL: torch.Tensor | None = None, **attn_kwargs) -> torch.Tensor:
        """Values at every position, B x L, fp32 (packed rows: `position_ids_BL` and `attn_kwargs`)."""
        hidden_BLH = self.backbone(input_ids=input_ids_BL, attention_mask=attention_mask_BL,
                                   position_ids=position_ids_BL, use_cache=False, **attn_kwargs).last_hidden_state
        # h . w + b in fp32 as one fresh tensor (an FSDP2 root must not return a view, as squeeze gives).
        w, b = self.value_head.weight[0].float(), self.value_head.bias.float()
        return hidden_BLH.float() @ w + b


def load_value_model(path: str) -> ValueModel:
    """The decoder of the causal LM at `path` (learner.critic_path, default model.path) + a new head."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(path, dtype=torch.float32)
    backbone.config.use_cache = False
    return ValueModel(backbone, backbone.config.hidden_size)


def values_BT(critic: nn.Module, batch: Batch) -> torch.Tensor:
    """V at the positions that predict the batch's targets, B x T (T = L - 1), zero off the mask."""
    return critic(batch.input_ids_BL, batch.attention_mask_BL)[:, :-1] * batch.loss_mask_BT


def micro_values(critic: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """V at a micro-batch's completion-predicting positions, flat in the order of its `flat_N`."""
    v_BL = critic(mb.input_ids, mb.attention_mask, mb.position_ids, **mb.attn_kwargs)
    B, L = v_BL.shape
    return v_BL.reshape(-1).index_select(0, mb.rows + mb.rows // (L - 1))


def old_values(critic: nn.Module, step: StepBatch, plan: StepPlan, cfg: Config, rank: int = 0,
               pad_id: int = 0) -> torch.Tensor:
    """The behaviour batch's values before any update of this step (no graph), N floats on every rank."""
    from learners.step import forward_N, rank_micro_batches

    critic.eval()
    return forward_N(lambda mb: micro_values(critic, mb), step, rank_micro_batches(plan, rank), cfg.learner.packing,
                     pad_id)


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var[returns - V] / Var[returns] over valid tokens: 1 is a perfect critic, 0 no better than
    a constant, negative worse."""
    m = mask_BT.bool()
    ret, v = returns_BT[m], values_BT[m]
    if ret.numel() < 2:
        return 0.0
    var = ret.var()
    return float(1.0 - (ret - v).var() / var) if var > 0 else 0.0


def _clipped_value_error(critic: nn.Module, mb: MicroBatch, old_values_N: torch.Tensor, returns_N: torch.Tensor,
                         keep_N: torch.Tensor | None, clip: float,
                         weight_N: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(err_bT, mask_bT, wins_bT) of one micro-batch: the PPO clipped value error 0.5 * max((V - R)^2,
    (V_clipped - R)^2) (times each sequence's PF-PPO `weight_N`), the tokens it counts on, and where
    the clipped term was the larger one."""
    v = mb.grid(micro_values(critic, mb))
    old, ret, mask = mb.grid(old_values_N[mb.flat_N]), mb.grid(returns_N[mb.flat_N]), mb.mask_bT
    if keep_N is not None:
        mask = mask * mb.grid(keep_N.index_select(0, mb.flat_N)).to(mask.dtype)
    clipped = old + (v - old).clamp(-clip, clip)
    err = 0.5 * torch.maximum((v - ret) ** 2, (clipped - ret) ** 2)
    if weight_N is not None:
        err = err * mb.grid(weight_N.index_select(0, mb.flat_N))
    with torch.no_grad():
        wins = ((clipped.detach() - ret) ** 2 > (v.detach() - ret) ** 2) & mask.bool()
    return err, mask, wins


def _critic_stats(step: StepBatch, old_values_N: torch.Tensor, returns_N: torch.Tensor, parts: list,
                  wins_sum: torch.Tensor, num_counted: int, grad_norm) -> dict[str, float]:
    mask_ST = step.policy.mask()
    old_ST, ret_ST = step.policy.grid(old_values_N), step.policy.grid(returns_N)
    return {
        "value_loss": float(torch.stack(parts).mean()),
        "value_clip_frac": float(wins_sum) / max(num_counted, 1),
        "value_explained_var": explained_variance(old_ST, ret_ST, mask_ST),
        "value_mean": float((old_ST * mask_ST).sum() / mask_ST.sum().clamp(min=1)),
        "returns_mean": float((ret_ST * mask_ST).sum() / mask_ST.sum().clamp(min=1)),
        "value_grad_norm": float(grad_norm),
    }


def critic_update(critic: nn.Module, optimizer: torch.optim.Optimizer, step: StepBatch, plan: StepPlan,
                  old_values_N: torch.Tensor, returns_N: torch.Tensor, cfg: Config, rank: int = 0, world: int = 1,
                  pad_id: int = 0, scheduler=None, keep_N: torch.Tensor | None = None,
                  weight_N: torch.Tensor | None = None) -> dict[str, float]:
    """The PPO clipped value loss over the same mini- and micro-batches as the policy (`plan`), one
    optimizer step per mini-batch, aggregated by algorithm.critic_aggregation (default the token
    mean) and normalised over each whole mini-batch (as in `policy_update`).

    `keep_N` (the step's `Targets.keep_N`, algorithm.rollout_rs): the tokens rejection sampling kept.
    Rejected tokens leave the value loss and its token / sequence counts as they leave the policy
    loss: a token whose pi_prox / mu is out of bounds fits the value to a return it would not earn.
    `weight_N` (the step's `Targets.value_weight_N`, algorithm.pf_ppo): each token's sequence weight.

    Stats: this rank's part of the mean mini-batch value loss of the first epoch (the critic as it
    scored the batch on a first update; the ranks' parts add up to it), the fraction of this rank's
    tokens where the clipped term was the larger one, explained variance and mean of the old values
    (the whole step's), and the first update's gradient norm.
    """
    from asyncrl.algorithms.aggregation import aggregate_normalised
    from learners.step import kept_counts

    alg, lc = cfg.algorithm, cfg.learner
    clip = alg.value_clip or float("inf")  # 0: off
    norm_tokens = alg.loss_norm_tokens or cfg.generator.max_tokens
    kept_S = None
    if keep_N is not None:
        kept_S = torch.zeros(step.num_seqs, device=step.device).index_add_(0, step.seq_of_N, keep_N.float())
    critic.train()
    parts, grad_norm = [], None
    wins_sum = torch.zeros((), device=step.device)
    num_counted = 0
    for epoch, minibatches in enumerate(plan.epochs):
        for mbatch in minibatches:
            part = torch.zeros((), device=step.device)
            num_tokens, num_seqs = kept_counts(step, mbatch, kept_S)
            for seqs in mbatch.micro[rank]:
                mb = micro_batch(step, seqs, lc.packing, pad_id)
                err, mask, wins = _clipped_value_error(critic, mb, old_values_N, returns_N, keep_N, clip, weight_N)
                loss = aggregate_normalised(err, mask, alg.critic_aggregation, num_tokens, num_seqs, norm_tokens)
                (loss * world).backward()
                part += loss.detach()
                if epoch == 0 and mb.num_tokens:
                    wins_sum = wins_sum + wins.sum()
                    num_counted += int(mask.sum())
            norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), lc.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
            if grad_norm is None:
                grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if epoch == 0:
                parts.append(part)
    return _critic_stats(step, old_values_N, returns_N, parts, wins_sum, num_counted, grad_norm)
