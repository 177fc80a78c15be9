"""Off-policy correction in every policy loss, in float64 on small inputs.

For each registered loss: (a) with behaviour = proximal = current (staleness 0, one update per step)
the registered entry is its on-policy form, value and gradient; (b) with mu behind pi_prox the loss
and its gradient change exactly as the loss's declared correction says (asyncrl/registry.py
CORRECTIONS), computed here by hand from the log-probs. The inputs hold a group whose rewards are
all equal (advantage 0), a row with every token masked out, and tokens with extreme ratios.
Then the learner-side points: the sequence IS weight under token rejection, the critic under
rejection, the max-shifted entropy, the KL statistic at pi_prox, and the added entries."""

import math

import pytest
import torch

from asyncrl import registry
from asyncrl.algorithms import advantages as A
from asyncrl.algorithms import losses as L
from asyncrl.algorithms import rollout_correction as RC
from asyncrl.config import AlgorithmConfig, ConfigError, load_config
from asyncrl.protocol import schema

F64 = torch.float64
NAMES = registry.POLICY_LOSSES.names()


def t(x):
    return torch.tensor(x, dtype=F64)


def inputs(seed=0):
    """4 sequences x 5 tokens: row 0 ragged, row 1 a group of one distinct reward (advantage 0),
    row 2 entirely masked out, row 3 with an extreme behaviour ratio (e^+-30) on two tokens."""
    g = torch.Generator().manual_seed(seed)
    prox = -0.2 - 2.0 * torch.rand(4, 5, generator=g, dtype=F64)
    lag = 0.4 * torch.randn(4, 5, generator=g, dtype=F64)
    lag[3, 1], lag[3, 3] = 30.0, -30.0
    behav = prox - lag  # log mu: pi_prox / mu = exp(lag)
    adv = t([[1.3], [0.0], [0.7], [-0.9]]).expand(4, 5).clone()
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    return prox, behav, adv, mask


def alg_for(name, **kw):
    # cov.ratio large enough that clip_cov / kl_cov pick tokens on 15 valid tokens.
    return AlgorithmConfig(**{"loss": name, "is_cap": 3.0, "cov": {"ratio": 0.2, "lb": -10.0, "ub": 10.0},
                              "dro": {"beta": 0.5}, **kw})


def run(name, logp, prox, behav, adv, mask, valid=None, seed=0, **kw):
    """(per-token loss, d sum(mask * loss) / d logp) of the registered entry."""
    logp = logp.clone().requires_grad_()
    torch.manual_seed(seed)  # clip_cov draws its detached tokens at random
    loss, stats = L.policy_loss(L.LossInputs(logp, prox, behav, adv, mask, alg_for(name, **kw), valid))
    (g,) = torch.autograd.grad((loss * mask).sum(), logp)
    assert all(torch.isfinite(torch.as_tensor(v)).all() for v in stats.values()), (name, stats)
    return loss.detach(), g


def on_policy(name, logp, prox, adv, mask, seed=0):
    """Each loss's on-policy form: the loss's own function, without the behaviour policy."""
    a = alg_for(name)
    lp = logp.clone().requires_grad_()
    torch.manual_seed(seed)
    forms = {
        "decoupled_ppo": lambda: L.ppo_clip(lp, prox, adv, mask, a.clip_low, a.clip_high),
        "ppo": lambda: L.ppo_clip(lp, prox, adv, mask, a.clip_low, a.clip_high),
        "tis": lambda: (-adv * lp, {}),
        "mis": lambda: (-adv * lp, {}),
        "cispo": lambda: (-adv * lp, {}),
        "gspo": lambda: L.gspo(lp, prox, adv, mask, a.clip_low, a.clip_high),
        "gmpo": lambda: L.geo_mean_ppo(lp, prox, adv, mask, a.clip_low, a.clip_high),
        "sapo": lambda: L.sapo(lp, prox, adv, mask, a.sapo.tau_pos, a.sapo.tau_neg),
        "gpg": lambda: (-adv * lp, {}),
        "clip_cov": lambda: L.clip_cov(lp, prox, adv, mask, a.clip_low, a.clip_high, a.cov.ratio, a.cov.lb, a.cov.ub),
        "kl_cov": lambda: L.kl_cov(lp, prox, adv, mask, a.cov.ratio, a.cov.kl_coef),
        "dppo_tv": lambda: L.dppo(lp, prox, adv, mask, a.clip_low, a.clip_high, a.dppo.ratio_cap, "tv"),
        "dppo_kl": lambda: L.dppo(lp, prox, adv, mask, a.clip_low, a.clip_high, a.dppo.ratio_cap, "kl"),
        "dro": lambda: (-adv * lp, {}),
    }
    assert set(forms) == set(NAMES), "every registered loss needs its on-policy form here"
    loss, _ = forms[name]()
    (g,) = torch.autograd.grad((loss * mask).sum(), lp)
    return loss.detach(), g


def test_every_loss_declares_a_known_correction():
    for name in NAMES:
        assert registry.POLICY_LOSSES.static_meta(name)["correction"] in registry.CORRECTIONS, name


@pytest.mark.parametrize("name", NAMES)
def test_on_policy_form_at_staleness_zero(name):
    """mu = pi_prox = pi (one update per step): every correction is exactly 1 / inactive."""
    prox, _, adv, mask = inputs()
    loss, g = run(name, prox, prox, prox, adv, mask)
    want_loss, want_g = on_policy(name, prox, prox, adv, mask)
    m = mask.bool()
    assert torch.allclose(loss[m], want_loss[m], rtol=1e-12, atol=1e-12), name
    assert torch.allclose(g, want_g, rtol=1e-12, atol=1e-12), name
    assert g[1].abs().max() == 0 and g[2].abs().max() == 0, "equal rewards and masked rows train nothing"


def _is_w_by_hand(prox, behav, valid, kind, level, cap, low=0.5, high=2.0):
    """The declared behaviour weight from the log-probs, without the library's helpers."""
    rho = torch.exp(prox - behav)
    if kind == "behaviour_weight" and level == "token":
        return torch.minimum(rho, torch.full_like(rho, cap))
    if kind == "behaviour_weight":
        prod = torch.tensor([math.exp(min(sum(float(prox[b, j] - behav[b, j]) for j in range(prox.shape[1])
                                                  if valid[b, j]), math.log(cap))) for b in range(prox.shape[0])],
                            dtype=F64)
        return prod[:, None].expand_as(prox)
    if kind == "seq_geo_weight":
        out = []
        for b in range(prox.shape[0]):
            d = [float(prox[b, j] - behav[b, j]) for j in range(prox.shape[1]) if valid[b, j]]
            out.append(min(math.exp(sum(d) / len(d)), cap) if d else 1.0)
        return t(out)[:, None].expand_as(prox)
    assert kind == "masked_weight"
    return rho * ((rho >= low) & (rho <= high))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("name", NAMES)
def test_correction_applied_when_behaviour_lags(name, level):
    """Staleness > 0, first update (pi = pi_prox) and a later one (pi moved from pi_prox): the loss
    and gradient are the on-policy ones changed exactly as the declared correction says."""
    prox, behav, adv, mask = inputs()
    kind = registry.POLICY_LOSSES.static_meta(name)["correction"]
    for logp in (prox, prox + 0.05 * torch.randn(prox.shape, generator=torch.Generator().manual_seed(3),
                                                   dtype=F64)):
        loss, g = run(name, logp, prox, behav, adv, mask, is_level=level)
        base_loss, base_g = on_policy(name, logp, prox, adv, mask)
        m = mask.bool()
        assert torch.isfinite(loss[m]).all() and torch.isfinite(g).all(), "extreme ratios stay finite"
        r = torch.exp(logp - prox)
        if kind in registry.IS_WEIGHT_CORRECTIONS:
            w = _is_w_by_hand(prox, behav, mask, kind, level, cap=3.0)
            if name in ("tis", "mis"):  # REINFORCE: the drift since pi_prox rides on top, sg(pi / pi_prox)
                w = w * r
            assert torch.allclose(loss[m], (w * base_loss)[m], rtol=1e-10, atol=1e-12), name
            assert torch.allclose(g, w * base_g, rtol=1e-10, atol=1e-12), name
            assert not torch.allclose(g, base_g), "the lag changes the gradient"
        elif name == "ppo":
            a = alg_for(name)
            ratio = torch.exp(logp - behav)
            clipped = ratio.clamp(1 - a.clip_low, 1 + a.clip_high)
            unclipped = (-adv * ratio >= -adv * clipped)
            assert torch.allclose(g, (-adv * ratio * unclipped) * mask, rtol=1e-10, atol=1e-12)
        elif name == "cispo":
            w = torch.exp(logp - behav).clamp(0.8, 1.2)
            assert torch.allclose(g, -adv * w * mask, rtol=1e-10, atol=1e-12)
        elif name in ("dppo_tv", "dppo_kl"):
            # Same trust-region mask around pi_prox; the truncated ratio is against mu instead.
            w_mu = torch.exp((logp - behav).clamp(-20, 20)).clamp(max=20.0)
            w_prox = torch.exp((logp - prox).clamp(-20, 20)).clamp(max=20.0)
            assert torch.allclose(g, base_g * w_mu / w_prox, rtol=1e-10, atol=1e-12)
        else:
            assert name == "dro"
            assert torch.allclose(g, (-adv + 0.5 * (logp - behav)) * mask, rtol=1e-10, atol=1e-12)
        assert g[2].abs().max() == 0, "a masked row trains nothing"


def test_sequence_weight_counts_every_response_token_before_rejection():
    """is_level=sequence with a token rejected: the weight is the product over the whole sequence."""
    prox = t([[-1.0, -1.0, -1.0]])
    behav = t([[-1.2, -1.1, -3.0]])  # rho = e^0.2, e^0.1, e^2 (the last is rejected)
    kept = t([[1, 1, 0]])
    valid = t([[1, 1, 1]])
    adv = t([[1.0, 1.0, 1.0]])
    _, g_fixed = run("decoupled_ppo", prox, prox, behav, adv, kept, valid=valid, is_level="sequence", is_cap=100.0)
    _, g_kept_only = run("decoupled_ppo", prox, prox, behav, adv, kept, is_level="sequence", is_cap=100.0)
    assert torch.allclose(g_fixed, -t([[math.exp(2.3), math.exp(2.3), 0.0]]))
    assert torch.allclose(g_kept_only, -t([[math.exp(0.3), math.exp(0.3), 0.0]]))


def test_is_normalize_weights_and_normaliser_at_pi_prox():
    """The normaliser is the batch mean (over kept tokens) of the weights the loss applies, both at
    pi_prox: the loss's weights divided by it average exactly 1, whichever update of the step."""
    prox, behav, adv, mask = inputs()
    for name in ("decoupled_ppo", "tis", "gspo", "mis", "sapo"):
        alg = alg_for(name)
        w, level = L.is_weight_at_prox(alg, prox, behav, mask)
        scale = RC.batch_mean_weight(w, mask, level)
        loss, _ = run(name, prox, prox, behav, adv, mask)  # the weights the loss applied
        base, _ = on_policy(name, prox, prox, adv, mask)
        applied = torch.where(base != 0, loss / base, torch.zeros_like(base))
        m = mask.bool() & (base != 0)
        assert torch.allclose(applied[m], w[m], rtol=1e-10), name
        if level == "token":
            assert ((w / scale) * mask).sum() / mask.sum() == pytest.approx(1.0), name


def test_rejection_k1_asymmetric_bounds_and_sequence_masking():
    lr = torch.log(t([[1.0, 0.6, 4.0], [1.0, 1.1, 0.3], [0.45, 1.0, 1.0]]))
    mask = t([[1, 1, 1], [1, 1, 0], [1, 1, 1]])
    # [0.5, 5]: IcePop's band. Symmetric [1/5, 5] keeps the 0.3 and 0.45 tokens; [0.5, 5] does not.
    assert RC.token_k1(lr, mask, 5.0).tolist() == [[True] * 3, [True] * 3, [True] * 3]
    assert RC.token_k1(lr, mask, 5.0, 0.5).tolist() == [[True, True, True], [True, True, False], [False, True, True]]
    # seq_max_k1: a sequence goes whole when a valid token leaves the band (a padded one does not count).
    assert RC.seq_max_k1(lr, mask, 5.0, 0.5)[:, 0].tolist() == [True, True, False]
    assert RC.seq_max_k1(lr, mask, 2.0)[:, 0].tolist() == [False, True, False]
    keep, st = RC.rejection_mask(lr, mask, ["token_k1", "seq_max_k1"], [5.0, 5.0], [0.5, 0.5])
    assert keep.tolist() == [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    assert st["rs_seq_max_k1_frac"].item() == pytest.approx(3 / 8)


def test_config_refusals_name_the_key(monkeypatch):
    with pytest.raises(ConfigError, match="algorithm.rollout_rs_lower for token_k1 must be in"):
        load_config(None, ["algorithm.rollout_rs=token_k1", "algorithm.rollout_rs_threshold=[2.0]",
                           "algorithm.rollout_rs_lower=[3.0]"])
    with pytest.raises(ConfigError, match="algorithm.rollout_rs_lower bounds the ratio of a"):
        load_config(None, ["algorithm.rollout_rs=token_k2", "algorithm.rollout_rs_lower=[0.5]"])
    cfg = load_config(None, ["algorithm.rollout_rs=[token_k1,seq_max_k1]", "algorithm.rollout_rs_threshold=[5.0]",
                             "algorithm.rollout_rs_lower=[0.5]", "algorithm.is_normalize=true", "algorithm.loss=gspo"])
    assert cfg.algorithm.rollout_rs_lower == [0.5]
    # A loss declaring no correction is refused with stale samples, and allowed at max_staleness=0.
    real = registry.POLICY_LOSSES.static_meta
    monkeypatch.setattr(registry.POLICY_LOSSES, "static_meta",
                        lambda n: {} if n == "gpg" else real(n))
    with pytest.raises(ConfigError, match="algorithm.loss=gpg does not correct for stale samples"):
        load_config(None, ["algorithm.loss=gpg", "algorithm.max_staleness=2"])
    assert load_config(None, ["algorithm.loss=gpg", "algorithm.max_staleness=0"]).algorithm.loss == "gpg"


def test_dro_by_hand():
    logp, behav = t([[-1.0, -2.0]]), t([[-1.5, -2.0]])
    loss, g = run("dro", logp, logp, behav, t([[2.0, -1.0]]), t([[1, 1]]))
    assert torch.allclose(loss, t([[2.0 + 0.25 * 0.25, -2.0]]))
    assert torch.allclose(g, t([[-2.0 + 0.5 * 0.5, 1.0]]))


def test_gdpo_normalises_each_component_then_the_batch():
    r = t([[[1.0, 0.0], [0.0, 10.0], [1.0, 10.0], [0.0, 0.0]],
           [[1.0, 5.0], [1.0, 5.0], [1.0, 5.0], [1.0, 5.0]]])  # group 1: one distinct reward vector
    adv = A.gdpo(r)
    per_k = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)
    s = per_k.sum(-1)
    assert torch.allclose(adv, (s - s.mean()) / (s.std() + 1e-6))
    assert torch.allclose(adv[1], torch.full((4,), adv[1, 0].item(), dtype=F64)), "no signal inside the tied group"
    # Summing first (GRPO on r1 + r2) ties samples 1 and 2 of group 0 differently than GDPO does.
    grpo = A.grpo(r.sum(-1))
    assert not torch.allclose(torch.argsort(grpo[0]), torch.argsort(adv[0])) or grpo[0, 0] != adv[0, 0]
    x = A.AdvantageInputs(r[..., 0], torch.ones(8, 2, dtype=F64), AlgorithmConfig(advantage="gdpo"))
    got, _ = A.estimate(x)
    one = (r[..., 0] - r[..., 0].mean(1, keepdim=True)) / (r[..., 0].std(1, keepdim=True) + 1e-6)
    assert torch.allclose(got[:, 0], ((one - one.mean()) / (one.std() + 1e-6)).reshape(-1))


def test_tir_optimal_token_baseline_aligns_by_model_token():
    g = torch.Generator().manual_seed(0)
    scores = t([1.0, 0.0, 0.5, 1.0])
    logp = -torch.rand(4, 6, generator=g, dtype=F64) - 0.1
    sum_pi2 = 0.2 + 0.5 * torch.rand(4, 6, generator=g, dtype=F64)
    dense = t([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    want = A.optimal_token_baseline(scores, dense, logp, sum_pi2, 2)
    assert torch.allclose(A.tir_optimal_token_baseline(scores, dense, logp, sum_pi2, 2), want), "no holes: OTB"
    # Insert tool-output holes (masked positions) inside rows 0 and 2: the model's tokens keep their
    # advantages, aligned by their index among the model's tokens.
    cols = {0: [0, 2, 3, 5], 1: [0, 1, 2], 2: [0, 1, 2, 3, 4], 3: [0, 1]}
    holed, lp, sp = torch.zeros(4, 8, dtype=F64), torch.zeros(4, 8, dtype=F64), torch.zeros(4, 8, dtype=F64)
    for b, cs in cols.items():
        for k, c in enumerate(cs):
            holed[b, c], lp[b, c], sp[b, c] = 1.0, logp[b, k], sum_pi2[b, k]
    got = A.tir_optimal_token_baseline(scores, holed, lp, sp, 2)
    for b, cs in cols.items():
        assert torch.allclose(got[b, cs], want[b, :len(cs)]), b
    assert got[holed == 0].abs().max() == 0
    by_position = A.optimal_token_baseline(scores, holed, lp, sp, 2)
    assert not torch.allclose(by_position, got), "aligning by position is a different baseline"


def test_pf_ppo_weights_by_hand():
    r = t([1.0, 0.0, 0.5, -2.0])
    w = A.pf_ppo_weights(r, "pow", 2.0)
    raw = t([1.0, 0.0, 0.25, 4.0]) + 1e-8
    assert torch.allclose(w, raw / raw.mean())
    mm = A.pf_ppo_weights(r, "max_min")
    assert torch.allclose(mm, (t([1, 0, 0, 1]) + 1e-8) / (t([1, 0, 0, 1]) + 1e-8).mean())
    mr = A.pf_ppo_weights(r, "max_random")
    assert torch.allclose(mr, t([0.4, 0.1, 0.1, 0.1]) / 0.175, rtol=1e-6)
    assert torch.allclose(A.pf_ppo_weights(torch.zeros(3, dtype=F64), "pow"), torch.ones(3, dtype=F64))


# ---- through the learner's functions (a tiny float64 model) -------------------------------------------


def _step_and_targets(overrides, groups=None, model=None, **kw):
    from learners.batch import build_step
    from learners.step import batch_targets
    from tests.test_microbatch import plan_for, ragged_groups, tiny_lm

    cfg = load_config(None, overrides)
    step = build_step(groups or ragged_groups(4, seed=2), "cpu")
    plan = plan_for(step, cfg)
    model = model or tiny_lm()
    return cfg, step, plan, model, batch_targets(model, step, plan, cfg, **kw)


def _seq_weight_N(step, prox_N, cap):
    log_w_S = torch.zeros(step.num_seqs, dtype=F64).index_add_(0, step.seq_of_N, (prox_N - step.behav_N).double())
    return torch.exp(log_w_S.clamp(max=math.log(cap)))[step.seq_of_N]


def test_learner_sequence_weight_is_over_the_whole_sequence_under_token_rejection():
    from learners.step import policy_update

    cfg, step, plan, model, targets = _step_and_targets(
        ["algorithm.is_level=sequence", "algorithm.is_cap=1e12", "algorithm.rollout_rs=[token_k1]",
         "algorithm.rollout_rs_threshold=[6.0]"])
    kept = targets.keep_N.bool()
    assert 0 < kept.double().mean() < 1, "some tokens rejected, not all"
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), step, plan, cfg, targets)
    # First update: ratio 1, so the loss is -sum_kept w_seq * A / kept, w_seq over every token.
    w = _seq_weight_N(step, targets.prox_N.double(), 1e12)
    want = -(w * targets.adv_N)[kept].sum() / kept.sum()
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-6)
    log_w_kept = torch.zeros(step.num_seqs, dtype=F64).index_add_(
        0, step.seq_of_N, ((targets.prox_N - step.behav_N).double() * kept))
    kept_only = -(torch.exp(log_w_kept)[step.seq_of_N] * targets.adv_N)[kept].sum() / kept.sum()
    assert stats["loss"] != pytest.approx(kept_only.item(), rel=1e-3), "the kept-only product is another loss"


def test_critic_ignores_rejected_tokens():
    from learners.critic import ValueModel, critic_update, old_values
    from tests.test_microbatch import tiny_lm

    cfg, step, plan, _, targets = _step_and_targets(
        ["algorithm.rollout_rs=[token_k1]", "algorithm.rollout_rs_threshold=[6.0]"])
    torch.manual_seed(0)
    critic = ValueModel(tiny_lm(seed=1).model, 32).double()
    torch.nn.init.normal_(critic.value_head.weight, std=0.3)
    kept = targets.keep_N.bool()
    old = old_values(critic, step, plan, cfg).double()
    returns = torch.randn(step.num_tokens, dtype=F64)

    def update(ret):
        opt = torch.optim.SGD(critic.parameters(), lr=0.0)
        st = critic_update(critic, opt, step, plan, old, ret, cfg, keep_N=targets.keep_N)
        return st, critic.value_head.weight.grad

    grads = []
    orig = torch.optim.SGD.step

    def capture(self, *a, **k):
        grads.append(critic.value_head.weight.grad.detach().clone())
        return orig(self, *a, **k)

    torch.optim.SGD.step = capture
    try:
        st, _ = update(returns)
        other = returns.clone()
        other[~kept] += 100.0  # rejected tokens' returns do not matter
        st2, _ = update(other)
    finally:
        torch.optim.SGD.step = orig
    assert st["value_loss"] == pytest.approx((0.5 * (old - returns)[kept] ** 2).mean().item(), rel=1e-6)
    assert st2["value_loss"] == pytest.approx(st["value_loss"], rel=1e-9)
    assert torch.allclose(grads[0], grads[1], rtol=1e-9, atol=1e-12) and grads[0].abs().sum() > 0


def test_entropy_is_exact_at_large_logits():
    """Logits near 40: the max-shifted fp32 entropy is within 1e-6 of float64; the unshifted
    formula lse - sum p z (the difference of two numbers near 40) is not."""
    from learners.logprobs import ChunkedLinearLogprob

    torch.manual_seed(0)
    n, h, v = 64, 8, 50
    hid = torch.randn(n, h, dtype=F64)
    w = 0.5 * torch.randn(v, h, dtype=F64)
    b = torch.full((v,), 40.0, dtype=F64)
    _, ent = ChunkedLinearLogprob.apply(hid, w, b, torch.zeros(n, dtype=torch.long), 1.0, 16, 0, True)
    log_p = torch.log_softmax(hid @ w.T + b, dim=-1)
    ref = -(log_p.exp() * log_p).sum(-1)
    rel = ((ent.double() - ref).abs() / ref).max().item()
    z = (hid @ w.T + b).float()
    lse = torch.logsumexp(z, dim=-1)
    unshifted = lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)
    rel_unshifted = ((unshifted.double() - ref).abs() / ref).max().item()
    assert rel < 1e-6 < rel_unshifted, (rel, rel_unshifted)


def test_kl_statistic_is_measured_at_pi_prox_with_several_updates():
    from asyncrl.algorithms.kl import kl_estimate
    from learners.batch import build_step
    from learners.step import logprobs_N, policy_update, rank_micro_batches
    from tests.test_microbatch import plan_for, ragged_groups, tiny_lm

    overrides = ["learner.minibatches=2", "learner.batch_groups=4", "algorithm.kl_coef=0.1", "algorithm.kl_target=0.01"]
    cfg = load_config(None, overrides)
    step = build_step(ragged_groups(4, seed=2), "cpu")
    plan = plan_for(step, cfg)
    assert plan.num_updates == 2
    ref_N = logprobs_N(tiny_lm(seed=1), step, rank_micro_batches(plan, 0), cfg, 0)
    _, _, _, model, targets = _step_and_targets(overrides, ref_N=ref_N, kl_coef=0.1)
    want = kl_estimate(targets.prox_N, ref_N, "k3").mean()  # no rejection: every token
    assert targets.stats["kl"].item() == pytest.approx(want.item(), rel=1e-6)
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=5.0), step, plan, cfg, targets, kl_coef=0.1)
    assert stats["kl"] == pytest.approx(want.item(), rel=1e-6), "not moved by the first mini-batch's update"


def test_pf_ppo_loss_weights_by_hand():
    w = torch.tensor([1.6, 0.4], dtype=F64)
    tokens = torch.tensor([1.0, 3.0], dtype=F64)
    # Sequence aggregations: the expected draws of verl's resampling, as they are.
    assert torch.equal(A.pf_ppo_loss_weights(w, tokens, "seq_mean_token_mean"), w)
    # token_mean: rescaled to a token mean of 1, 4 / (1.6 * 1 + 0.4 * 3) = 4 / 2.8.
    assert torch.allclose(A.pf_ppo_loss_weights(w, tokens, "token_mean"), torch.tensor([16 / 7, 4 / 7], dtype=F64))
    assert torch.equal(A.pf_ppo_loss_weights(w, torch.zeros(2, dtype=F64), "token_mean"), w)


def _groups_of(lengths, rewards, num_groups=1):
    """`num_groups` groups of samples with these completion lengths and rewards."""
    from tests.test_microbatch import ragged_groups

    groups = ragged_groups(num_groups, n=len(lengths), seed=5)
    for gi, g in enumerate(groups):
        g.samples = [schema.Sample(completion_ids=schema.pack_i32([7 + gi + i for i in range(k)]),
                                   logprobs=schema.pack_f32([-1.0] * k), versions=schema.pack_i32([0] * k), reward=r)
                     for k, r in zip(lengths, rewards, strict=True)]
    return groups


@pytest.mark.parametrize("aggregation,want", [("seq_mean_token_mean", [2.0, 0.0]), ("token_mean", [5.0, 0.0])])
def test_pf_ppo_weights_read_the_reward_after_the_overlong_penalty(aggregation, want):
    """Rewards 1 and 1, lengths 2 and 8 with max_tokens 8 and a 4-token overlong buffer: the long
    sample's reward is 1 - 1 * (8 - 4) / 4 = 0, so pow weights |r|^2 are 1 and 0 (x2 for mean 1);
    token_mean rescales them by 10 tokens / (2 * 2) to 5 and 0. On the raw rewards both would be 1."""
    overrides = ["algorithm.pf_ppo=pow", "generator.max_tokens=8", "algorithm.overlong_buffer=4",
                 f"algorithm.aggregation={aggregation}"]
    _, step, _, _, t = _step_and_targets(overrides, groups=_groups_of([2, 8], [1.0, 1.0]))
    w_S = torch.zeros(2, dtype=F64).index_add_(0, step.seq_of_N, t.weight_N.double()) / torch.tensor([2.0, 8.0],
                                                                                                      dtype=F64)
    assert torch.allclose(w_S, torch.tensor(want, dtype=F64), atol=1e-6)


def test_pf_ppo_weighs_every_loss_term_of_a_sample():
    """With lr 0 the first update is at ratio 1, so the seq_mean_token_sum loss is
    sum_t w_t * (policy_t + kl_coef * KL_t - entropy_coef * H_t) / sequences: the sample's PF-PPO
    weight on the policy, KL-in-loss and entropy terms alike (verl's resampling repeats or drops all
    of them), the advantages themselves unscaled. Two groups of a long rewarded sample (weight 1.6)
    and a short unrewarded one (0.4), so weighting the KL and entropy sums moves them by ~40%."""
    from asyncrl.algorithms.kl import kl_estimate
    from learners.step import forward_N, logprobs_N, micro_logprobs, policy_update, rank_micro_batches
    from tests.test_microbatch import tiny_lm

    groups = _groups_of([10, 2], [1.0, 0.0], num_groups=2)
    agg = "algorithm.aggregation=seq_mean_token_sum"
    overrides = [agg, "algorithm.pf_ppo=max_random", "algorithm.kl_coef=0.3", "algorithm.kl_in=loss",
                 "algorithm.entropy_coef=0.05"]
    cfg = load_config(None, overrides)
    _, step, plan, model, plain = _step_and_targets([agg], groups=groups)
    micro = rank_micro_batches(plan, 0)
    ref_N = logprobs_N(tiny_lm(seed=1), step, micro, cfg, 0)
    _, _, _, _, t = _step_and_targets(overrides, groups=groups, model=model, ref_N=ref_N, kl_coef=0.3)
    assert torch.equal(t.adv_N, plain.adv_N)
    w_N = torch.tensor([1.6, 0.4, 1.6, 0.4], dtype=F64)[step.seq_of_N]  # 0.4 and 0.1 over their mean 0.25
    assert torch.allclose(t.weight_N.double(), w_N, rtol=1e-6)
    m = step.mask_N.double()
    logp_N = logprobs_N(model, step, micro, cfg, 0).double()
    ent_N = forward_N(lambda mb: micro_logprobs(model, mb, cfg.generator.temperature, with_entropy=True)[1],
                      step, micro, cfg.learner.packing, 0).double()
    kl_N = kl_estimate(logp_N, ref_N.double(), "k3")
    for x in (kl_N, ent_N):  # the weighted sums are far from the unweighted ones
        assert (w_N * x * m).sum() > 1.2 * (x * m).sum()
    # decoupled_ppo at ratio 1: -min(pi / mu, is_cap) * A.
    policy_N = -torch.exp(logp_N - step.behav_N.double()).clamp(max=2.0) * t.adv_N.double()
    others_N = 0.3 * kl_N - 0.05 * ent_N
    want = (w_N * (policy_N + others_N) * m).sum() / 4
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0), step, plan, cfg, t, kl_coef=0.3)
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-6)
    policy_only = ((w_N * policy_N + others_N) * m).sum() / 4  # the weight on the advantage alone
    assert stats["loss"] != pytest.approx(policy_only.item(), rel=0.05)


def test_pf_ppo_weighs_each_sample_value_loss():
    """The critic's update with the step's PF-PPO value weights: the first update's value loss (lr 0, V = V_old) is
    sum_t w_t * 0.5 * (V_t - R_t)^2 / sequences under critic_aggregation=seq_mean_token_sum, w each
    sample's PF-PPO weight (mean 1 over sequences there)."""
    from learners.critic import ValueModel, critic_update, old_values
    from learners.step import pf_ppo_token_weights
    from tests.test_microbatch import tiny_lm

    cfg, step, plan, _, _ = _step_and_targets(["algorithm.pf_ppo=max_random",
                                               "algorithm.critic_aggregation=seq_mean_token_sum"])
    _, value_w_N = pf_ppo_token_weights(step, step.rewards_S, None, cfg.algorithm)
    w_S = A.pf_ppo_weights(step.rewards_S.double(), "max_random")  # seq_mean_*: the weights as they are
    assert torch.allclose(value_w_N.double(), w_S[step.seq_of_N], rtol=1e-6)
    torch.manual_seed(0)
    critic = ValueModel(tiny_lm(seed=1).model, 32).double()
    torch.nn.init.normal_(critic.value_head.weight, std=0.3)
    old = old_values(critic, step, plan, cfg).double()
    returns = torch.randn(step.num_tokens, dtype=F64)
    st = critic_update(critic, torch.optim.SGD(critic.parameters(), lr=0.0), step, plan, old, returns, cfg,
                       weight_N=value_w_N)
    err_N = 0.5 * (old - returns) ** 2 * step.mask_N.double()
    want = (w_S[step.seq_of_N] * err_N).sum() / step.num_seqs
    assert st["value_loss"] == pytest.approx(want.item(), rel=1e-6)
    assert st["value_loss"] != pytest.approx((err_N.sum() / step.num_seqs).item(), rel=1e-3)
