"""learner.kernel_warmup: a step on synthetic groups that leaves the training exactly where it was."""

import copy

import pytest
import torch

from asyncrl.algorithms.losses import AdaptiveKLController
from asyncrl.config import load_config
from learners.batch import build_step
from learners.step import batch_targets, policy_update
from learners.warmup import frozen_training_state, synthetic_groups
from tests.test_microbatch import VOCAB, plan_for, ragged_groups, tiny_lm


def _parts(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # A schedule whose rate changes every step, so a moved or restored step counter shows.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)
    return opt, sched


def _update(model, opt, sched, groups, cfg):
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg, budget=40)
    targets = batch_targets(model, step, plan, cfg)
    return policy_update(model, opt, step, plan, cfg, targets, scheduler=sched)


def test_synthetic_groups_have_the_runs_shape():
    groups = synthetic_groups(3, 4, prompt_tokens=5, completion_tokens=7, vocab_size=VOCAB, seed=1)
    assert len(groups) == 3 and all(len(g.samples) == 4 for g in groups)
    assert {s.num_tokens for g in groups for s in g.samples} == {7}
    assert sorted({s.reward for g in groups for s in g.samples}) == [0.0, 1.0], "advantages are not all zero"
    step = build_step(groups, "cpu")
    assert max(int(t.max()) for t in step.tokens) < VOCAB and step.num_seqs == 12
    assert step.prompt_len == [5] * 12 and step.comp_len == [7] * 12
    assert step.baselines_G is not None, "advantage=remax finds the greedy baseline it needs"


def test_warm_up_step_leaves_weights_optimizer_schedule_and_kl_controller_as_they_were():
    cfg = load_config(None, ["learner.minibatches=2", "learner.batch_groups=4"])
    warm, cold = tiny_lm(seed=3), tiny_lm(seed=3)
    warm_opt, warm_sched = _parts(warm)
    cold_opt, cold_sched = _parts(cold)
    kl = AdaptiveKLController(0.1, 0.05, 1000)
    kl_before = copy.deepcopy(kl.__dict__)

    torch.manual_seed(11)
    next_draws = torch.rand(3)
    torch.manual_seed(11)
    with frozen_training_state([warm_opt], [warm_sched], kl):
        stats = _update(warm, warm_opt, warm_sched, synthetic_groups(4, 4, 5, 7, VOCAB), cfg)
        kl.update(5.0, 16)  # the learner's step moves the controller; the warm-up's move is undone
        torch.rand(5)  # a loss or dropout drawing random numbers; the draws after it are as before
    assert torch.equal(torch.rand(3), next_draws), "the random number generator is as it was"
    assert stats["grad_norm"] > 0, "the synthetic step computed real gradients"
    for (name, a), b in zip(warm.named_parameters(), cold.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} moved during the warm-up"
        assert a.grad is None
    assert not warm_opt.state, "the synthetic moments are gone"
    assert warm_sched.last_epoch == cold_sched.last_epoch == 0
    assert [g["lr"] for g in warm_opt.param_groups] == [g["lr"] for g in cold_opt.param_groups]
    assert kl.__dict__ == kl_before

    # The first real steps from the warmed state are the ones a cold learner takes, to the bit.
    for seed in (0, 1):
        groups = ragged_groups(4, seed=seed)
        _update(warm, warm_opt, warm_sched, groups, cfg)
        _update(cold, cold_opt, cold_sched, groups, cfg)
    for (name, a), b in zip(warm.named_parameters(), cold.parameters(), strict=True):
        assert torch.equal(a, b), f"{name} differs after two real steps"
    assert warm_sched.last_epoch == cold_sched.last_epoch == 4


def test_warm_up_refuses_an_optimizer_that_holds_state():
    cfg = load_config(None, ["learner.batch_groups=4"])
    model = tiny_lm()
    opt, sched = _parts(model)
    _update(model, opt, sched, ragged_groups(4), cfg)
    with pytest.raises(RuntimeError, match="before the first step only"):
        with frozen_training_state([opt], [sched], AdaptiveKLController(0.0, None, 1)):
            pass
