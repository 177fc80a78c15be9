"""The critic for algorithm.advantage=gae: a value model and its PPO value update.

The value model is the decoder of a causal LM (`AutoModel`, e.g. `Qwen2Model` from a
`Qwen2ForCausalLM` checkpoint) with a scalar head, rather than `AutoModelForTokenClassification`:
every causal-LM checkpoint loads as its decoder, while token-classification classes exist only for
some architectures; and it does not hold the unused V x H output projection. Under FSDP2 it is
sharded like the policy (each decoder layer, then the root with embeddings, final norm and head).

Alignment: values_BT[b, j] = V(prefix up to token j), the value of the state in which token j+1 is
sampled, so it lines up with the batch's targets_BT / loss_mask_BT (learners/batch.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from asyncrl.advantages import value_loss

if TYPE_CHECKING:
    from asyncrl.config import Config
    from learners.batch import Batch


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

    def forward(self, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor) -> torch.Tensor:
        """Values at every position, B x L, fp32."""
        hidden_BLH = self.backbone(input_ids=input_ids_BL, attention_mask=attention_mask_BL,
                                   use_cache=False).last_hidden_state
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


def old_values(critic: nn.Module, batch: Batch) -> torch.Tensor:
    """The behaviour batch's values before any update of this step (no graph)."""
    critic.eval()
    with torch.no_grad():
        return values_BT(critic, batch)


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """1 - Var[returns - V] / Var[returns] over valid tokens: 1 is a perfect critic, 0 no better than
    a constant, negative worse."""
    m = mask_BT.bool()
    ret, v = returns_BT[m], values_BT[m]
    if ret.numel() < 2:
        return 0.0
    var = ret.var()
    return float(1.0 - (ret - v).var() / var) if var > 0 else 0.0


def critic_update(critic: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, old_values_BT: torch.Tensor,
                  returns_BT: torch.Tensor, cfg: Config, loss_scale: float, scheduler=None) -> dict[str, float]:
    """`learner.ppo_epochs * learner.minibatches` updates of the PPO clipped value loss, like the policy.

    `loss_scale` is the rank's token share (as in `policy_update`). Stats: the value loss of the first
    update (the critic as it scored the batch), the fraction of tokens where the clipped term was the
    larger one (0 on a first update, where V = V_old), explained variance and mean of the old values.
    """
    alg, lc = cfg.algorithm, cfg.learner
    clip = alg.value_clip or float("inf")  # 0: off
    mask = batch.loss_mask_BT
    m = mask.bool()
    critic.train()
    losses, clip_fracs, grad_norm = [], [], None
    for _ in range(lc.ppo_epochs * lc.minibatches):
        v = values_BT(critic, batch)
        loss = value_loss(v, old_values_BT, returns_BT, mask, clip)
        (loss * loss_scale).backward()
        norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), lc.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
        if grad_norm is None:
            grad_norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        with torch.no_grad():
            losses.append(float(loss.detach()))
            clipped = old_values_BT + (v.detach() - old_values_BT).clamp(-clip, clip)
            wins = (clipped - returns_BT) ** 2 > (v.detach() - returns_BT) ** 2
            clip_fracs.append(float(wins[m].float().mean()) if m.any() else 0.0)
    return {
        "value_loss": losses[0],
        "value_clip_frac": sum(clip_fracs) / len(clip_fracs),
        "value_explained_var": explained_variance(old_values_BT, returns_BT, mask),
        "value_mean": float(old_values_BT[m].mean()) if m.any() else 0.0,
        "returns_mean": float(returns_BT[m].mean()) if m.any() else 0.0,
        "value_grad_norm": float(grad_norm),
    }
