"""The exact entropy from the chunked log-prob pass (value and gradient against the full-logits
closed form), its bonus in the learner's loss, and rollout rejection / IS normalisation through the
learner's functions: every split of a step still gives the whole step's update, in float64."""

import math

import pytest
import torch

from asyncrl.algorithms.rollout_correction import rejection_mask
from asyncrl.config import load_config
from learners.batch import build_step
from learners.logprobs import ChunkedLinearLogprob
from learners.step import batch_targets, policy_update
from tests.test_microbatch import one_update, plan_for, ragged_groups, tiny_lm

F64 = torch.float64


@pytest.mark.parametrize("keep_bytes", [0, 1 << 20], ids=["recompute", "keep"])
def test_chunked_entropy_matches_the_full_softmax(keep_bytes):
    torch.manual_seed(0)
    n, h, v, temp = 9, 6, 13, 0.7
    hid = torch.randn(n, h, dtype=F64, requires_grad=True)
    w = torch.randn(v, h, dtype=F64, requires_grad=True)
    b = torch.randn(v, dtype=F64, requires_grad=True)
    y = torch.randint(0, v, (n,))
    g_logp, g_ent = torch.randn(n, dtype=F64), torch.randn(n, dtype=F64)
    logp, ent = ChunkedLinearLogprob.apply(hid, w, b, y, temp, 4, keep_bytes, True)
    ours = torch.autograd.grad((logp * g_logp + ent * g_ent).sum(), (hid, w, b))
    log_p = torch.log_softmax((hid @ w.T + b) / temp, dim=-1)
    ref_logp, ref_ent = log_p.gather(1, y[:, None]).squeeze(1), -(log_p.exp() * log_p).sum(-1)
    ref = torch.autograd.grad((ref_logp * g_logp + ref_ent * g_ent).sum(), (hid, w, b), retain_graph=True)
    # The chunks compute in fp32 by design (never an fp64 copy of the logits): fp32 tolerances.
    assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
    for a, r in zip(ours, ref, strict=True):
        assert torch.allclose(a.double(), r, atol=1e-4), (a - r).abs().max()
    # Only the entropy in the loss: the log-prob output has no gradient and is skipped.
    (gh,) = torch.autograd.grad(ChunkedLinearLogprob.apply(hid, w, b, y, temp, 4, keep_bytes, True)[1].sum(), hid)
    (rh,) = torch.autograd.grad(ref_ent.sum(), hid)
    assert torch.allclose(gh.double(), rh, atol=1e-4)


def test_entropy_of_uniform_and_one_hot_rows():
    w = torch.zeros(7, 3, dtype=F64)
    w[2, 0] = 1000.0
    hid = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    _, ent = ChunkedLinearLogprob.apply(hid, w, None, torch.tensor([0, 2]), 1.0, 1, 0, True)
    assert ent[0].item() == pytest.approx(math.log(7), abs=1e-6) and abs(ent[1].item()) < 1e-6


def _full_entropy_mean(model, step, temperature):
    """Token mean of the exact entropy over the step's completion positions, from full logits."""
    total, count = 0.0, 0
    for s, toks in enumerate(step.tokens):
        ids = torch.as_tensor(toks, dtype=torch.long)[None]
        p, c = step.prompt_len[s], step.comp_len[s]
        if c == 0:
            continue
        log_p = torch.log_softmax(model(ids).logits[0, p - 1:p - 1 + c].double() / temperature, dim=-1)
        total = total - (log_p.exp() * log_p).sum()
        count += c
    return total / count


def test_entropy_metric_and_bonus_in_the_learner_step():
    groups = ragged_groups(2, seed=3)
    cfg0 = load_config(None, ["generator.temperature=0.8"])
    cfg1 = load_config(None, ["generator.temperature=0.8", "algorithm.entropy_coef=0.3"])
    st0, g0, _ = one_update(tiny_lm(), groups, cfg0, budget=10_000)
    st1, g1, _ = one_update(tiny_lm(), groups, cfg1, budget=60)
    model = tiny_lm()
    step = build_step(groups, "cpu")
    ent = _full_entropy_mean(model, step, 0.8)
    assert st0["entropy"] == pytest.approx(ent.item(), rel=1e-6)
    assert st1["entropy"] == pytest.approx(ent.item(), rel=1e-6)
    assert "entropy_sampled" in st0 and st0["entropy_sampled"] != pytest.approx(st0["entropy"])
    # The bonus's gradient is -coef * d(token-mean entropy): the difference of the two updates.
    grads = torch.autograd.grad(-0.3 * ent, [p for _, p in model.named_parameters()], allow_unused=True)
    for (name, _), want in zip(model.named_parameters(), grads, strict=True):
        want = torch.zeros_like(g0[name]) if want is None else want
        assert torch.allclose(g1[name] - g0[name], want.to(g0[name].dtype), atol=1e-6), name
    assert st1["loss"] == pytest.approx(st0["loss"] - 0.3 * ent.item(), rel=1e-6, abs=1e-7)


CORRECTIONS = [
    ["algorithm.rollout_rs=[token_k1,seq_mean_k3]", "algorithm.rollout_rs_threshold=[4.0,1.0]"],
    ["algorithm.rollout_rs=[seq_sum_k1]", "algorithm.rollout_rs_threshold=[3.0]", "algorithm.is_normalize=true"],
    ["algorithm.is_normalize=true", "algorithm.loss=tis", "algorithm.aggregation=seq_mean_token_sum_norm"],
    ["algorithm.is_normalize=true", "algorithm.loss=mis", "algorithm.aggregation=token_sum"],
    ["algorithm.is_normalize=true", "algorithm.is_level=sequence", "algorithm.aggregation=seq_mean_token_mean",
     "algorithm.rollout_rs=[token_k2]", "algorithm.rollout_rs_threshold=[0.5]"],
]


@pytest.mark.parametrize("overrides", CORRECTIONS, ids=lambda o: ",".join(x.split("=")[1] for x in o))
def test_corrections_one_micro_batch_equals_many(overrides):
    cfg = load_config(None, overrides)
    groups = ragged_groups(4)
    whole_stats, whole, plan1 = one_update(tiny_lm(), groups, cfg, budget=10_000)
    split_stats, split, plan8 = one_update(tiny_lm(), groups, cfg, budget=40)
    assert plan8.micro_batches(0) >= 4
    # The head's log-probs are computed in fp32 chunks (as in the chunked-entropy test above), so
    # the loss of a split step differs from the whole one by fp32 rounding (seen: 1.2e-6 relative).
    assert split_stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5, abs=1e-9)
    for n, g in whole.items():
        assert torch.allclose(split[n], g, rtol=1e-5, atol=1e-7), (n, (split[n] - g).abs().max())
    assert any(g.abs().sum() > 0 for g in whole.values())
    if cfg.algorithm.rollout_rs:
        assert 0 < whole_stats["rs_token_reject_frac"] < 1, "the thresholds reject some tokens, not all"
    if cfg.algorithm.is_normalize:
        assert whole_stats["is_norm_factor"] != pytest.approx(1.0)


def test_rejected_tokens_leave_the_loss_and_its_counts():
    """Rejection equals training on the kept tokens only: the same gradient as a loss whose mask
    drops them, normalised by the kept count (token_mean)."""
    cfg = load_config(None, ["algorithm.rollout_rs=[token_k1]", "algorithm.rollout_rs_threshold=[4.0]",
                             "algorithm.loss=tis", "algorithm.is_cap=100"])
    groups = ragged_groups(2, seed=5)
    model = tiny_lm()
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg)
    targets = batch_targets(model, step, plan, cfg)
    keep_ST, st = rejection_mask(step.grid(targets.prox_N - step.behav_N.double()),
                                 step.grid(torch.ones(step.num_tokens, dtype=F64)), ["token_k1"], [4.0])
    assert torch.equal(targets.keep_N.bool(), step.flat(keep_ST).bool())
    assert 0 < st["rs_token_reject_frac"] < 1
    kept = targets.keep_N.bool()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = policy_update(model, opt, step, plan, cfg, targets)
    # TIS at the first update: loss = -sum_kept min(pi/mu, C) * A * log pi / kept, with pi = pi_prox.
    w = torch.exp(targets.prox_N - step.behav_N.double()).clamp(max=100)
    want = -(w * targets.adv_N * targets.prox_N)[kept].sum() / kept.sum()
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-6)
    assert stats["rs_token_reject_frac"] == pytest.approx(1 - kept.double().mean().item())
