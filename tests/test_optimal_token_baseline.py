"""The optimal-token-baseline advantage (algorithm.advantage=optimal_token_baseline): closed-form values
on small inputs, the chunked sum of squared probabilities against the full softmax, and a whole
learner step through batch_targets."""

import pytest
import torch

from asyncrl.algorithms.advantages import AdvantageInputs, estimate, optimal_token_baseline
from asyncrl.config import load_config
from asyncrl.protocol import schema
from learners.batch import build_step
from learners.step import batch_targets, logprobs_sum_pi2_N, policy_update, rank_micro_batches
from tests.test_microbatch import plan_for, ragged_groups, tiny_lm

F64 = torch.float64


def test_closed_form_two_samples_with_a_lone_tail_and_kl():
    mask = torch.tensor([[1, 1], [1, 0]], dtype=F64)
    scores = torch.tensor([1.0, 0.0], dtype=F64)
    logp = torch.log(torch.tensor([[0.5, 0.25], [1.0, 1.0]], dtype=F64))
    pi2 = torch.tensor([[0.5, 0.25], [1.0, 1.0]], dtype=F64)
    # w = 1 - 2 pi + sum pi^2: sample 0 [0.5, 0.75] -> W [0.5, 1.25]; sample 1 [0] (a certain token).
    # t=0: B = (1 * 0.5 + 0 * 0) / 0.5 = 1; t=1: only sample 0 runs, so B = 0.
    adv = optimal_token_baseline(scores, mask, logp, pi2, group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 1.0], [-1.0, 0.0]], dtype=F64))
    kl = torch.tensor([[0.1, 0.2], [0.0, 0.0]], dtype=F64)  # returns to go of sample 0: [0.7, 0.8]
    adv = optimal_token_baseline(scores, mask, logp, pi2, group_size=2, kl_BT=kl, eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.8], [-0.7, 0.0]], dtype=F64))


def test_equal_energies_give_the_group_mean_baseline_and_edge_cases_stay_finite():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(12, generator=g, dtype=F64)
    mask = torch.ones(12, 5, dtype=F64)
    logp = torch.full((12, 5), -1.0, dtype=F64)
    pi2 = torch.full((12, 5), 0.3, dtype=F64)
    adv = optimal_token_baseline(scores, mask, logp, pi2, group_size=4)
    want = (scores.view(3, 4) - scores.view(3, 4).mean(1, keepdim=True)).reshape(-1)
    assert torch.allclose(adv, want[:, None].expand(12, 5), atol=1e-9)
    # An empty completion, a group with one distinct reward, extreme probabilities: finite, masked.
    mask[1] = 0
    logp[2] = 0.0  # pi = 1: no energy
    pi2[2] = 1.0
    same = optimal_token_baseline(torch.ones(12, dtype=F64), mask, logp, pi2, group_size=4)
    assert torch.isfinite(same).all() and same[1].abs().sum() == 0
    assert torch.allclose(same[4:], torch.zeros(8, 5, dtype=F64))


def _brute_force_sum_pi2(model, groups):
    """sum_v pi_v^2 at every completion token, from the full softmax of each sequence alone."""
    rows = []
    with torch.no_grad():
        for grp in groups:
            prompt = list(schema.unpack_i32(grp.prompt_ids))
            for s in grp.samples:
                comp = list(schema.unpack_i32(s.completion_ids))
                if not comp:
                    continue
                ids = torch.tensor([prompt + comp])
                p = torch.softmax(model(ids).logits[0].double(), -1)[len(prompt) - 1:-1]
                rows.append((p * p).sum(-1))
    return torch.cat(rows)


@pytest.mark.parametrize("packing", [True, False])
def test_chunked_sum_pi2_matches_the_full_softmax(packing):
    model = tiny_lm().eval()
    groups = ragged_groups(3, seed=4)
    cfg = load_config(None, [f"learner.packing={str(packing).lower()}", "algorithm.advantage=optimal_token_baseline"])
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg, budget=40)
    logp_N, pi2_N = logprobs_sum_pi2_N(model, step, rank_micro_batches(plan, 0), cfg, 0)
    assert torch.allclose(pi2_N.double(), _brute_force_sum_pi2(model, groups), atol=1e-6)
    assert (pi2_N > 0).all() and (pi2_N <= 1 + 1e-6).all() and (logp_N < 0).all()


def test_a_learner_step_with_the_optimal_token_baseline():
    model = tiny_lm()
    groups = ragged_groups(4, seed=2)
    cfg = load_config(None, ["algorithm.advantage=optimal_token_baseline"])
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg)
    targets = batch_targets(model, step, plan, cfg)
    logp_N, pi2_N = logprobs_sum_pi2_N(model, step, rank_micro_batches(plan, 0), cfg, 0)
    mask = step.grid(torch.ones(step.num_tokens))
    x = AdvantageInputs(step.rewards_S.float().view(-1, step.group_size), mask, cfg.algorithm,
                        logp_BT=step.grid(logp_N), sum_pi2_BT=step.grid(pi2_N))
    assert torch.allclose(targets.adv_N, step.flat(estimate(x)[0]), atol=1e-6)
    assert targets.prox_N is not None  # the same pass gave the proximal log-probs
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats = policy_update(model, opt, step, plan, cfg, targets, 0, 1)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0


def test_is_weights_scale_each_tokens_energy_by_rho_squared():
    # Three samples of one prompt, each token's energy w = 1 - 2 pi + sum pi^2 = 0.5 (pi = 0.5, sum = 0.5).
    mask = torch.ones(3, 2, dtype=F64)
    scores = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    logp = torch.full((3, 2), torch.log(torch.tensor(0.5, dtype=F64)).item(), dtype=F64)
    pi2 = torch.full((3, 2), 0.5, dtype=F64)
    plain = optimal_token_baseline(scores, mask, logp, pi2, group_size=3, eps=0.0)
    ones = optimal_token_baseline(scores, mask, logp, pi2, group_size=3, eps=0.0, is_weights_BT=torch.ones(3, 2))
    assert torch.equal(plain, ones)
    # rho = [[2, 2], [1, 1], [1, 0]]: energies 0.5 rho^2 -> W0 = [2, 4], W1 = [0.5, 1], W2 = [0.5, 0.5].
    # B_0 = (1 * 2) / 3 = 2/3, B_1 = (1 * 4) / 5.5 = 8/11.
    rho = torch.tensor([[2.0, 2.0], [1.0, 1.0], [1.0, 0.0]], dtype=F64)
    adv = optimal_token_baseline(scores, mask, logp, pi2, group_size=3, eps=0.0, is_weights_BT=rho)
    b = torch.tensor([2 / 3, 8 / 11], dtype=F64)
    assert torch.allclose(adv, scores[:, None] - b[None, :], atol=1e-12)


def test_a_learner_step_with_is_weighted_optimal_token_baseline():
    from asyncrl.algorithms.losses import behaviour_weight_tis

    model = tiny_lm()
    groups = ragged_groups(4, seed=3)
    cfg = load_config(None, ["algorithm.advantage=optimal_token_baseline", "algorithm.otb_is_weights=true",
                             "algorithm.is_cap=1.5"])
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg)
    targets = batch_targets(model, step, plan, cfg)
    logp_N, pi2_N = logprobs_sum_pi2_N(model, step, rank_micro_batches(plan, 0), cfg, 0)
    mask = step.grid(torch.ones(step.num_tokens))
    rho = behaviour_weight_tis(step.grid(logp_N), step.grid(step.behav_N.float()), 1.5) * mask
    assert (rho < 1.5).any() and (rho[mask.bool()] != 1).any()  # the weights are not all one
    x = AdvantageInputs(step.rewards_S.float().view(-1, step.group_size), mask, cfg.algorithm,
                        logp_BT=step.grid(logp_N), sum_pi2_BT=step.grid(pi2_N), is_weights_BT=rho)
    assert torch.allclose(targets.adv_N, step.flat(estimate(x)[0]), atol=1e-6)
    unweighted = batch_targets(model, step, plan, load_config(None, ["algorithm.advantage=optimal_token_baseline"]))
    assert not torch.allclose(targets.adv_N, unweighted.adv_N, atol=1e-6)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    stats = policy_update(model, opt, step, plan, cfg, targets, 0, 1)
    assert torch.isfinite(torch.tensor(stats["loss"])) and stats["grad_norm"] > 0


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.otb_is_weights=true"], "algorithm.advantage=optimal_token_baseline"),
    (["algorithm.otb_is_weights=true", "algorithm.advantage=optimal_token_baseline", "algorithm.loss=ppo"],
     "algorithm.loss=ppo does not have"),
])
def test_is_weighted_otb_config_errors_name_the_fix(overrides, needle):
    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
