"""Every advantage / loss / KL function against values computed by hand on small tensors."""

import math

import pytest
import torch

from asyncrl.algorithms import advantages as A
from asyncrl.algorithms import kl as K
from asyncrl.algorithms import losses as L
from tests.helpers import gloo_group


def test_rloo_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    # sample 0: 1 - mean(0, 0, 1) = 2/3 ; sample 1: 0 - mean(1, 0, 1) = -2/3
    assert torch.allclose(A.rloo(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))


def test_grpo_and_dr_grpo():
    r = torch.tensor([[2.0, 0.0]])
    assert torch.allclose(A.grpo(r, norm_std=False), torch.tensor([[1.0, -1.0]]))
    assert torch.allclose(A.grpo(r, norm_std=True, eps=0.0), torch.tensor([[1.0, -1.0]]) / math.sqrt(2.0))


def test_reinforce_pp_returns_and_whitening():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = torch.tensor([1.0, 0.0])
    kl = torch.full((2, 3), 0.1)
    adv = A.reinforce_pp(rewards, mask, kl, kl_coef=1.0, eps=0.0)
    # returns (gamma=1): seq0 = [1-0.2, 1-0.1], seq1 = [-0.3, -0.2, -0.1]
    ret = torch.tensor([0.8, 0.9, -0.3, -0.2, -0.1])
    want = (ret - ret.mean()) / ret.std()
    got = adv[mask.bool()]
    assert torch.allclose(got, want, atol=1e-5)
    assert adv[0, 2] == 0


def test_reinforce_pp_baseline():
    mask = torch.ones(2, 2)
    adv = A.reinforce_pp_baseline(torch.tensor([[1.0, 0.0]]), mask, eps=0.0)
    v = torch.tensor([0.5, 0.5, -0.5, -0.5])
    assert torch.allclose(adv.reshape(-1), (v - v.mean()) / v.std())


def _whiten_worker(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    with gloo_group(rank, port, q):
        x, mask = _whiten_batch()
        rows = slice(0, 2) if rank == 0 else slice(2, 5)  # unequal shares, different token counts
        got = A.whiten(x[rows], mask[rows], eps=0.0, all_reduce=dist.all_reduce)
        rpp = A.reinforce_pp(x[rows, -1], mask[rows], eps=0.0, all_reduce=dist.all_reduce)
        q.put((rank, got.tolist(), rpp.tolist()))  # plain lists: a tensor's shared fd dies with the worker


def _whiten_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4, generator=g) * 3 + 2
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.float32)
    return x, mask


def test_whitening_over_two_ranks_equals_whole_batch_whitening():
    """Two gloo ranks holding 2 and 3 of 5 sequences: with all_reduce, each rank's whitened share
    equals the whole batch whitened on one rank (mean 0, unbiased std 1 over all valid tokens);
    without it, the shares would be whitened apart and differ."""
    import socket

    import torch.multiprocessing as mp

    x, mask = _whiten_batch()
    whole = A.whiten(x, mask, eps=0.0)
    valid = whole[mask.bool()]
    assert abs(float(valid.mean())) < 1e-6 and abs(float(valid.std()) - 1.0) < 1e-6
    assert torch.allclose(whole, (x - x[mask.bool()].mean()) / x[mask.bool()].std() * mask, atol=1e-6)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_whiten_worker, args=(port, q), nprocs=2, join=True, start_method="spawn")
    parts = {rank: (torch.tensor(got), torch.tensor(rpp)) for rank, got, rpp in (q.get(timeout=10) for _ in range(2))}
    got = torch.cat([parts[0][0], parts[1][0]])
    assert torch.allclose(got, whole, atol=1e-6)
    assert not torch.allclose(A.whiten(x[:2], mask[:2], eps=0.0), whole[:2], atol=1e-3), "per-rank whitening differs"
    rpp = torch.cat([parts[0][1], parts[1][1]])
    assert torch.allclose(rpp, A.reinforce_pp(x[:, -1], mask, eps=0.0), atol=1e-6)


def test_gae_by_hand():
    mask = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.5, 0.2]])
    adv, ret = A.gae(torch.tensor([1.0]), values, mask, gamma=1.0, lam=0.5)
    # t=1: delta = 1 - 0.2 = 0.8 ; t=0: delta = 0 + 0.2 - 0.5 = -0.3, adv = -0.3 + 0.5 * 0.8 = 0.1
    assert torch.allclose(adv, torch.tensor([[0.1, 0.8]]))
    assert torch.allclose(ret, torch.tensor([[0.6, 1.0]]))


def test_ppo_clip_higher_and_dual_clip():
    logp = torch.log(torch.tensor([[1.5, 0.5, 4.0]]))
    prox = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, stats = L.ppo_clip(logp, prox, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    # tok0: A>0, ratio 1.5 -> clipped to 1.28 -> -1.28 ; tok1: A<0, ratio .5 -> max(0.5, 0.8) = 0.8
    # tok2: A<0, ratio 4 -> max(4, 1.2) = 4, dual clip bounds it at 3
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, 3.0]]))
    assert stats["clip_frac_high"] == pytest.approx(1 / 3) and stats["clip_frac_low"] == pytest.approx(1 / 3)


def test_token_and_sequence_tis_weights():
    prox = torch.tensor([[-1.0, -1.0]])
    behav = torch.tensor([[-1.5, -3.0]])
    w = L.behaviour_weight_tis(prox, behav, cap=2.0)
    assert torch.allclose(w, torch.tensor([[math.exp(0.5), 2.0]]))
    ws = L.behaviour_weight_seq_tis(prox, behav, torch.ones(1, 2), cap=5.0)
    assert torch.allclose(ws, torch.full((1, 2), min(math.exp(2.5), 5.0)))


def test_mis_masks_out_of_band_tokens():
    logp = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, -4.0, 1.0]])  # ratios 1, e^3, e^-2
    loss, stats = L.mis_pg(logp, behav, torch.ones(1, 3), torch.ones(1, 3), low=0.5, high=2.0)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, 0.0, 0.0]]))
    assert stats["masked_frac"] == pytest.approx(2 / 3)


def test_cispo_keeps_gradient_on_clipped_tokens():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    behav = torch.tensor([[-1.0, 0.0]])  # ratio e on token 0 -> clipped to 1.28
    loss, _ = L.cispo(logp, behav, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.28)
    loss.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1.28, -1.0]]))


def test_gspo_sequence_ratio():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    prox = torch.tensor([[-1.2, -2.2]])  # mean log-ratio 0.2 -> s = e^0.2 ~ 1.221
    loss, stats = L.gspo(logp, prox, torch.ones(1, 2), torch.ones(1, 2), clip_low=0.1, clip_high=0.1)
    assert stats["seq_ratio_mean"] == pytest.approx(math.exp(0.2), rel=1e-5)
    # clipped at 1.1 for A > 0: loss -1.1 per token, no gradient
    assert torch.allclose(loss, torch.full((1, 2), -1.1))
    loss.sum().backward()
    assert torch.all(logp.grad == 0)


def test_decoupled_ppo_sequence_level():
    logp = torch.zeros(1, 2, requires_grad=True)
    prox = torch.zeros(1, 2)
    behav = torch.tensor([[-0.5, -0.5]])
    loss, stats = L.decoupled_ppo(logp, prox, behav, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2,
                                  is_cap=2.0, is_level="sequence")
    assert torch.allclose(loss, torch.full((1, 2), -2.0))  # e^1 capped at 2
    assert stats["is_weight_max"] == pytest.approx(2.0)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert K.kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert K.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert K.kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    with pytest.raises(ValueError, match="algorithm.kl_estimator: .k4. is not one of"):
        K.kl_estimate(logp, ref, "k4")


def test_adaptive_kl_controller_moves_towards_target():
    c = L.AdaptiveKLController(0.1, target=0.05, horizon=100)
    assert c.update(kl=0.5, num_samples=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    c2 = L.AdaptiveKLController(0.1, target=None, horizon=100)
    assert c2.update(kl=5.0, num_samples=10) == 0.1
