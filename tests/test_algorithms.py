"""Advantages and the decoupled-PPO loss against hand-computed values."""

import math

import torch

from asyncrl.algorithms.advantages import grpo as grpo_advantages
from asyncrl.algorithms.losses import decoupled_ppo
from tests.helpers import aggregate, token_logprobs


def test_grpo_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = grpo_advantages(r, norm_std=True, eps=0.0 + 1e-12)
    std = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    assert torch.allclose(adv[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / std, atol=1e-5)
    assert torch.allclose(adv[1], torch.zeros(4))  # zero-variance group: no signal
    dr = grpo_advantages(r, norm_std=False)
    assert torch.allclose(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(loss, mask, "token_mean").item() == (1 + 2 + 3 + 4) / 4
    assert aggregate(loss, mask, "seq_mean_token_mean").item() == (2.0 + 4.0) / 2
    assert aggregate(loss, mask, "seq_mean_token_sum").item() == (6.0 + 4.0) / 2


def test_decoupled_ppo_by_hand_with_clip_and_behaviour_cap():
    # Two tokens of one sequence, advantage +1. Token 0: ratio e^0.5 (clipped at 1.2), behaviour
    # weight e^0.1. Token 1: ratio 1, behaviour weight e^2 capped at C=2. Token 2 is masked.
    logp = torch.tensor([[-1.0, -2.0, -9.0]], requires_grad=True)
    prox = torch.tensor([[-1.5, -2.0, -9.0]])
    behav = torch.tensor([[-1.6, -4.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.ones(1, 3)
    loss_BT, stats = decoupled_ppo(logp, prox, behav, adv, mask, clip_low=0.2, clip_high=0.2, is_cap=2.0)
    loss = aggregate(loss_BT, mask, "token_mean")
    expected = -(math.exp(0.1) * 1.2 + 2.0 * 1.0) / 2
    assert abs(loss.item() - expected) < 1e-5
    assert abs(stats["is_weight_max"] - 2.0) < 1e-6
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0.0
    loss.backward()
    # Clipped token gets no gradient; the unclipped one gets -w * ratio / num_tokens.
    assert logp.grad[0, 0].item() == 0.0
    assert abs(logp.grad[0, 1].item() - (-2.0 * 1.0 / 2)) < 1e-6
    assert logp.grad[0, 2].item() == 0.0


def test_decoupled_equals_plain_ppo_when_behaviour_is_proximal():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    prox = logp.detach() + 0.1 * torch.randn(3, 5)
    adv = torch.randn(3)
    mask = (torch.rand(3, 5) > 0.3).float()
    loss_BT, _ = decoupled_ppo(logp, prox, prox, adv[:, None].expand(3, 5), mask, 0.2, 0.28, 2.0)
    loss = aggregate(loss_BT, mask, "token_mean")
    ratio = torch.exp(logp - prox)
    plain = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
    assert torch.allclose(loss, (plain * mask).sum() / mask.sum(), atol=1e-6)


def test_token_logprobs_chunked_matches_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(2, 7, 11)
    targets = torch.randint(0, 11, (2, 7))
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.allclose(token_logprobs(logits, targets, 0.7, chunk=3), ref, atol=1e-5)
