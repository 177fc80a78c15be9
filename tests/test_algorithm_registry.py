"""The algorithm registries: every name the config accepts is a registered function, the docs table
is the registry's, and each added estimator / loss / KL / aggregation / rollout correction matches a
hand-computed value on small float64 inputs, edge cases included."""

import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from asyncrl import registry
from asyncrl.algorithms import advantages as A
from asyncrl.algorithms import kl as K
from asyncrl.algorithms import losses as L
from asyncrl.algorithms import rollout_correction as RC
from asyncrl.algorithms.aggregation import aggregate_normalised
from asyncrl.config import AlgorithmConfig, ConfigError, load_config
from tests.helpers import aggregate

ROOT = Path(__file__).resolve().parent.parent
F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


# ---- the registries ---------------------------------------------------------------------------------


@pytest.mark.parametrize("reg", registry.FAMILIES, ids=lambda r: r.key)
def test_source_scan_names_equal_the_imported_registry(reg):
    entries = reg.entries()
    assert reg.names() == tuple(entries), "the config reads names from the source; they must match the import"
    for name, e in entries.items():
        assert e.summary and e.ref, name
        assert reg.static_meta(name) == e.meta


def test_config_values_come_from_the_registries():
    hints = typing.get_type_hints(AlgorithmConfig)
    for field, reg in (("advantage", registry.ADVANTAGES), ("loss", registry.POLICY_LOSSES),
                       ("kl_estimator", registry.KL_ESTIMATORS), ("aggregation", registry.AGGREGATIONS),
                       ("critic_aggregation", registry.AGGREGATIONS)):
        assert typing.get_args(hints[field]) == reg.names(), field
    (item,) = typing.get_args(hints["rollout_rs"])
    assert typing.get_args(item) == registry.ROLLOUT_CORRECTIONS.names()
    with pytest.raises(ConfigError, match=r"algorithm.loss: 'ppo2' is not one of \['decoupled_ppo'"):
        load_config(None, ["algorithm.loss=ppo2"])
    with pytest.raises(ConfigError, match=r"algorithm.rollout_rs\[1\]: 'seq_k9' is not one of"):
        load_config(None, ["algorithm.rollout_rs=token_k1,seq_k9"])


def test_config_cross_checks_name_the_key():
    with pytest.raises(ConfigError, match="algorithm.rollout_rs_threshold must hold one threshold or one per"):
        load_config(None, ["algorithm.rollout_rs=token_k1,token_k2,token_k3", "algorithm.rollout_rs_threshold=[2,3]"])
    with pytest.raises(ConfigError, match="rollout_rs_threshold for token_k1 bounds the ratio to"):
        load_config(None, ["algorithm.rollout_rs=token_k1", "algorithm.rollout_rs_threshold=[0.5]"])
    with pytest.raises(ConfigError, match="algorithm.is_normalize=true rescales a behaviour IS weight"):
        load_config(None, ["algorithm.is_normalize=true", "algorithm.loss=cispo"])
    cfg = load_config(None, ["algorithm.rollout_rs=[token_k1,seq_max_k3]", "algorithm.rollout_rs_threshold=[2.0,0.5]",
                             "algorithm.is_normalize=true", "algorithm.loss=tis"])
    assert cfg.algorithm.rollout_rs == ["token_k1", "seq_max_k3"]


def test_loading_the_config_imports_no_torch():
    code = ("import sys; from asyncrl.config import load_config; "
            "load_config(None, ['algorithm.loss=gmpo', 'algorithm.rollout_rs=token_k1']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_docs_table_is_the_registry():
    text = (ROOT / "docs" / "algorithms.md").read_text()
    assert registry.docs_tables() in text, "run `python -m asyncrl.registry --write docs/algorithms.md`"
    for reg in registry.FAMILIES:
        for name in reg.names():
            assert f"| `{name}` |" in text


# ---- aggregations -------------------------------------------------------------------------------------


LOSS = t([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
MASK = t([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # the third completion is empty


def test_new_aggregations_by_hand():
    assert aggregate(LOSS, MASK, "token_sum").item() == 10.0
    # Dr. GRPO: token sums over the constant (generation budget 8), mean over the 3 sequences.
    assert aggregate(LOSS, MASK, "seq_mean_token_sum_norm", norm_tokens=8).item() == pytest.approx((6 + 4 + 0) / (3 * 8))
    assert aggregate(LOSS, MASK, "seq_mean_token_sum_norm").item() == pytest.approx(10 / (3 * 3))  # default T


@pytest.mark.parametrize("mode", registry.AGGREGATIONS.names())
def test_every_aggregation_splits_exactly(mode):
    """Parts (whole sequences) normalised by the whole batch's counts sum to the whole batch's aggregate."""
    torch.manual_seed(0)
    loss, mask = torch.randn(6, 5, dtype=F64), (torch.rand(6, 5) > 0.3).to(F64)
    mask[2] = 0
    whole = aggregate_normalised(loss, mask, mode, int(mask.sum()), 6, 7)
    parts = sum(aggregate_normalised(loss[i:i + 2], mask[i:i + 2], mode, int(mask.sum()), 6, 7) for i in (0, 2, 4))
    assert parts.item() == pytest.approx(whole.item(), rel=1e-12)


# ---- KL ------------------------------------------------------------------------------------------------


def test_abs_and_straight_through_kl():
    ref = t([[-1.0, -2.0]])
    logp = t([[-0.5, -2.5]]).requires_grad_()
    assert torch.equal(K.kl_estimate(logp, ref, "abs").detach(), t([[0.5, 0.5]]))
    for plus, plain in (("k1+", "k1"), ("k3+", "k3")):
        v = K.kl_estimate(logp, ref, plus)
        assert torch.allclose(v.detach(), K.kl_estimate(logp, ref, plain).detach(), atol=0, rtol=0)
        (g,) = torch.autograd.grad(v.sum(), logp)
        assert torch.allclose(g, t([[0.5, -0.5]])), "k2's gradient: log r"
    (g3,) = torch.autograd.grad(K.kl_estimate(logp, ref, "k3").sum(), logp)
    assert torch.allclose(g3, 1 - torch.exp(-t([[0.5, -0.5]]))), "plain k3's gradient differs"


# ---- advantages ---------------------------------------------------------------------------------------


def _inputs(scores, mask, **alg):
    return A.AdvantageInputs(t(scores), t(mask), AlgorithmConfig(**alg))


def test_opo_length_weighted_baseline():
    # Lengths 1, 3 (group 0), rewards 1, 0: baseline (1*1 + 3*0) / 4 = 0.25.
    x = _inputs([[1.0, 0.0]], [[1, 0, 0], [1, 1, 1]], advantage="opo")
    adv, ret = A.estimate(x)
    assert ret is None
    assert torch.allclose(adv, t([[0.75, 0, 0], [-0.25, -0.25, -0.25]]))
    # Every completion empty: the plain mean, and no advantage on any (absent) token.
    assert torch.allclose(A.opo(t([[1.0, 0.0]]), t([[0, 0]])), t([[0.5, -0.5]]))


def test_grpo_passk_credits_only_the_best():
    r = t([[0.0, 3.0, 1.0, 1.0]])
    assert torch.allclose(A.grpo_passk(r, norm_std=False), t([[0, 2.0, 0, 0]]))
    std = float(r.std())
    assert torch.allclose(A.grpo_passk(r, norm_std=True, eps=0.0), t([[0, 2.0 / std, 0, 0]]))
    tie = A.grpo_passk(t([[1.0, 1.0, 0.0]]), norm_std=True)
    assert torch.count_nonzero(tie) == 0, "a tie at the top credits nobody"


def test_gpg_alpha_rescales_by_nonzero_rewards():
    r = t([[1.0, 0.0], [0.0, 0.0]])  # 1 of 4 samples has a non-zero reward: alpha = 4
    assert torch.allclose(A.gpg(r), t([[2.0, -2.0], [0.0, 0.0]]))
    assert torch.count_nonzero(A.gpg(torch.zeros(2, 3, dtype=F64))) == 0


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "opo", "gpg", "grpo_passk"])
def test_one_distinct_reward_gives_no_signal(name):
    adv, _ = A.estimate(_inputs([[0.7, 0.7, 0.7], [1.0, 0.0, 0.0]], [[1, 1], [1, 0], [0, 0], [1, 1], [1, 0], [1, 1]],
                                advantage=name))
    assert torch.count_nonzero(adv[:3].abs() > 1e-6) == 0, "a group with one distinct reward has no advantage"
    assert adv[2].abs().sum() == 0, "an empty completion has no token to credit"


def test_reinforce_pp_discount_and_per_token_kl():
    # One sequence of 3 tokens, reward 1, KL penalty 0.1 per token, gamma 0.5; a second one of 1 token, reward 0.
    mask = t([[1, 1, 1], [1, 0, 0]])
    kl = t([[0.1, 0.1, 0.1], [0.1, 0.0, 0.0]])
    x = A.AdvantageInputs(t([[1.0, 0.0]]), mask, AlgorithmConfig(advantage="reinforce_pp", gamma=0.5), kl_BT=kl)
    adv, _ = A.estimate(x)
    r = [0.9, -0.1, -0.1]  # per-token rewards of sequence 0, reversed: t=2, 1, 0
    g2 = r[0]
    g1 = r[1] + 0.5 * g2
    g0 = r[2] + 0.5 * g1
    ret = t([g0, g1, g2, -0.1])
    want = (ret - ret.mean()) / (ret.std() + 1e-6)
    assert torch.allclose(adv[mask.bool()].to(F64), want, atol=1e-6)
    # Per token is not the last-token sum: with the sum at the end, token 0's return would differ.
    g0_sum_at_end = 0.25 * (1 - 0.3)
    assert abs(g0 - g0_sum_at_end) > 1e-3


def test_gae_subtracts_the_kl_at_each_token():
    mask, values = t([[1, 1]]), t([[0.0, 0.0]])
    adv, ret = A.gae(t([1.0]), values, mask, gamma=1.0, lam=1.0, kl_BT=t([[0.2, 0.1]]))
    assert torch.allclose(ret.to(F64), t([[0.7, 0.9]])) and torch.allclose(adv.to(F64), t([[0.7, 0.9]]))


# ---- policy losses ------------------------------------------------------------------------------------


def test_gmpo_geometric_mean_by_hand():
    # One sequence, two tokens, A = +1; log r = (0.1, 0.5), clip_high 0.2 clips the second to 0.2.
    prox = t([[-1.0, -1.0, -3.0]])
    logp = (prox + t([[0.1, 0.5, 9.0]])).requires_grad_()
    mask = t([[1, 1, 0]])
    loss_BT, st = L.geo_mean_ppo(logp, prox, t([[1.0, 1.0, 1.0]]), mask, 0.2, 0.2)
    s = math.exp((0.1 + 0.2) / 2)
    loss = aggregate(loss_BT, mask, "seq_mean_token_mean")
    assert loss.item() == pytest.approx(-s)
    (g,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(g, t([[-s / 2, 0.0, 0.0]])), "the clipped token and the masked one get no gradient"
    assert st["clip_frac_high"].item() == pytest.approx(0.5)
    # A < 0: the lower bound binds instead; log r = -0.5 is clipped to -0.2, +0.1 is not.
    logp2 = (prox + t([[-0.5, 0.1, 0.0]])).requires_grad_()
    loss2 = aggregate(L.geo_mean_ppo(logp2, prox, -torch.ones(1, 3, dtype=F64), mask, 0.2, 0.2)[0], mask,
                      "seq_mean_token_mean")
    assert loss2.item() == pytest.approx(math.exp((-0.2 + 0.1) / 2))


def test_sapo_gate_by_hand():
    prox = t([[-1.0, -1.0]])
    logp = (prox + t([[0.0, math.log(1.5)]])).requires_grad_()
    adv, mask = t([[1.0, -2.0]]), t([[1, 1]])
    loss, _ = L.sapo(logp, prox, adv, mask, tau_pos=1.0, tau_neg=2.0)
    want = [-1.0 * (1 / (1 + math.exp(0))) * 4.0, 2.0 * (1 / (1 + math.exp(-2 * 0.5))) * 4.0 / 2]
    assert torch.allclose(loss.detach(), t([want]))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    # d/dlogp of -A * sigmoid(tau (r-1)) * 4/tau = -A * 4 * sig' * r ; at r = 1, sig' = 1/4: the plain PG.
    sig = 1 / (1 + math.exp(-1.0))
    assert torch.allclose(g, t([[-1.0, 2.0 * 4 * sig * (1 - sig) * 1.5]]))
    # Extreme ratio: the gate saturates, loss finite, gradient ~0.
    big = (prox + t([[60.0, -60.0]])).requires_grad_()
    lb, _ = L.sapo(big, prox, adv, mask, 1.0, 1.0)
    (gb,) = torch.autograd.grad(lb.sum(), big)
    assert torch.isfinite(lb).all() and gb.abs().max() < 1e-6


def test_gpg_loss_is_plain_policy_gradient():
    logp = t([[-1.0, -2.0]]).requires_grad_()
    loss, _ = L.gpg(logp, t([[2.0, -1.0]]), t([[1, 1]]))
    assert torch.allclose(loss.detach(), t([[2.0, -2.0]]))
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(g, t([[-2.0, 1.0]]))


def test_clip_cov_detaches_high_covariance_tokens():
    # 4 tokens, ratio 1 (nothing PPO-clipped). Centred covariances: adv - 0 times logp - mean.
    logp = t([[-1.0, -3.0, -1.0, -3.0]]).requires_grad_()
    adv = t([[2.0, -2.0, -2.0, 2.0]])
    mask = torch.ones(1, 4, dtype=F64)
    # cov = adv * (logp + 2) = (2, 2, -2, -2): tokens 0 and 1 lie in (1, 5).
    loss, st = L.clip_cov(logp, logp.detach(), adv, mask, 0.2, 0.2, ratio=1.0, lb=1.0, ub=5.0)
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert torch.allclose(g, t([[0.0, 0.0, 2.0, -2.0]]))
    assert torch.allclose(loss.detach(), -adv), "the value is PPO's, only the gradient is dropped"
    assert st["cov_clip_frac"].item() == 0.5
    # ratio * tokens < 1: exactly one of the two candidates is picked.
    torch.manual_seed(0)
    loss1, _ = L.clip_cov(logp, logp.detach(), adv, mask, 0.2, 0.2, ratio=0.01, lb=1.0, ub=5.0)
    (g1,) = torch.autograd.grad(loss1.sum(), logp)
    assert int((g1[0, :2] == 0).sum()) == 1 and torch.allclose(g1[0, 2:], t([2.0, -2.0]))


def test_kl_cov_penalises_the_top_covariance_token():
    prox = t([[-1.0, -3.0, -2.0]])
    logp = (prox + t([[0.1, 0.0, -0.2]])).requires_grad_()
    adv, mask = t([[1.0, -1.0, 1.0]]), torch.ones(1, 3, dtype=F64)
    loss, st = L.kl_cov(logp, prox, adv, mask, ratio=0.34, coef=2.0)  # max(1, int(3 * 0.34)) = 1 token
    lp = logp.detach()
    cov = (adv - adv.mean()) * (lp - lp.mean())
    top = int(cov.argmax())
    r = torch.exp(lp - prox)
    want = -adv * r
    want[0, top] += 2.0 * abs(float(lp[0, top] - prox[0, top]))
    assert torch.allclose(loss.detach(), want)
    assert st["cov_kl_frac"].item() == pytest.approx(1 / 3)


def test_dppo_masks_by_probability_change():
    # Token probabilities old -> new: 0.5 -> 0.8 (A>0, +0.3 > 0.2: masked), 0.5 -> 0.6 (A>0, kept),
    # 0.5 -> 0.2 (A<0, -0.3 < -0.2: masked), 0.5 -> 0.45 (A<0, kept).
    prox = torch.log(t([[0.5, 0.5, 0.5, 0.5]]))
    logp = torch.log(t([[0.8, 0.6, 0.2, 0.45]])).requires_grad_()
    adv, mask = t([[1.0, 1.0, -1.0, -1.0]]), torch.ones(1, 4, dtype=F64)
    loss, st = L.dppo(logp, prox, adv, mask, 0.2, 0.2, ratio_cap=1.1, divergence="tv")
    (g,) = torch.autograd.grad(loss.sum(), logp)
    w = [1.1, 1.1, 0.4, 0.9]  # min(r, C)
    assert torch.allclose(g, t([[0.0, -w[1], 0.0, w[3]]]))
    assert st["trust_masked_frac"].item() == 0.5
    # Binary KL: Bernoulli(0.5) vs Bernoulli(p) = 0.5 log(0.5/p) + 0.5 log(0.5/(1-p)).
    def bkl(p):
        return 0.5 * math.log(0.5 / p) + 0.5 * math.log(0.5 / (1 - p))
    assert bkl(0.8) > 0.2 > bkl(0.6)
    loss_kl, _ = L.dppo(logp, prox, adv, mask, 0.2, 0.2, ratio_cap=1.1, divergence="kl")
    (gk,) = torch.autograd.grad(loss_kl.sum(), logp)
    keep = [bkl(0.8) <= 0.2, bkl(0.6) <= 0.2, bkl(0.2) <= 0.2, bkl(0.45) <= 0.2]
    assert torch.allclose(gk, t([[-w[0] * keep[0], -w[1] * keep[1], w[2] * keep[2], w[3] * keep[3]]]))
    # Extreme ratio: the truncated weight and the loss stay finite.
    huge = (prox + t([[80.0, -80.0, 0.0, 0.0]])).requires_grad_()
    lh, _ = L.dppo(huge, prox, adv, mask, 0.2, 0.2, 20.0, "tv")
    assert torch.isfinite(lh).all()


def test_registered_losses_run_on_every_name_with_masks():
    torch.manual_seed(1)
    logp = (torch.randn(3, 4, dtype=F64) - 2).requires_grad_()
    prox = logp.detach() + 0.1 * torch.randn(3, 4, dtype=F64)
    behav = logp.detach() + 0.3 * torch.randn(3, 4, dtype=F64)
    adv = torch.randn(3, 1, dtype=F64).expand(3, 4)
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    for name in registry.POLICY_LOSSES.names():
        loss_BT, stats = L.policy_loss(L.LossInputs(logp, prox, behav, adv, mask, AlgorithmConfig(loss=name)))
        assert loss_BT.shape == (3, 4) and torch.isfinite(loss_BT).all(), name
        (g,) = torch.autograd.grad(aggregate(loss_BT, mask, "token_mean"), logp)
        assert g[mask == 0].abs().sum() == 0, f"{name}: gradient on a masked token"
        assert all(torch.isfinite(torch.as_tensor(v)).all() for v in stats.values()), name


# ---- rollout corrections ------------------------------------------------------------------------------


LR = t([[0.0, math.log(3.0), -0.1, 0.0], [0.2, 0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
RMASK = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])


def k2(x):
    return 0.5 * x * x


def k3(x):
    return math.exp(x) - 1 - x


@pytest.mark.parametrize("name,threshold,kept_rows", [
    ("token_k1", 2.0, [[1, 0, 1], [1, 1]]),
    ("token_k2", k2(0.2) + 1e-9, [[1, 0, 1], [1, 1]]),
    ("token_k3", k3(0.2) + 1e-9, [[1, 0, 1], [1, 1]]),
    ("seq_sum_k1", 2.0, [[0, 0, 0], [1, 1]]),          # products 3 * e^-0.1 = 2.71 and e^0.4 = 1.49
    ("seq_sum_k1", 1.45, [[0, 0, 0], [0, 0]]),
    ("seq_mean_k1", 1.45, [[1, 1, 1], [1, 1]]),        # geometric means 1.44 and 1.22
    ("seq_mean_k1", 1.3, [[0, 0, 0], [1, 1]]),
    ("seq_sum_k2", 2 * k2(0.2) + 1e-9, [[0, 0, 0], [1, 1]]),
    ("seq_sum_k3", 2 * k3(0.2) + 1e-9, [[0, 0, 0], [1, 1]]),
    ("seq_mean_k2", k2(0.2) + 1e-9, [[0, 0, 0], [1, 1]]),
    ("seq_mean_k3", (k3(math.log(3)) + k3(-0.1)) / 3 + 1e-9, [[1, 1, 1], [1, 1]]),
    ("seq_max_k2", k2(0.2) + 1e-9, [[0, 0, 0], [1, 1]]),
    ("seq_max_k3", k3(math.log(3)) + 1e-9, [[1, 1, 1], [1, 1]]),
])
def test_rejection_criteria_by_hand(name, threshold, kept_rows):
    keep, st = RC.rejection_mask(LR, RMASK, [name], [threshold])
    assert keep[0, :3].tolist() == kept_rows[0] and keep[1, :2].tolist() == kept_rows[1]
    assert keep[RMASK == 0].abs().sum() == 0, "padding and the empty completion are never kept"
    rejected = 5 - sum(map(sum, kept_rows))
    assert st["rs_token_reject_frac"].item() == pytest.approx(rejected / 5)
    assert st["rs_seq_reject_frac"].item() == pytest.approx(sum(0 in r for r in kept_rows) / 2)


def test_rejection_criteria_chain_and_extreme_ratios():
    keep, st = RC.rejection_mask(LR, RMASK, ["token_k1", "seq_mean_k1"], [2.0, 1.3])
    assert keep[0, :3].tolist() == [0, 0, 0] and keep[1, :2].tolist() == [1, 1]
    assert st["rs_token_k1_frac"].item() == pytest.approx(1 / 5) and st["rs_seq_mean_k1_frac"].item() == pytest.approx(3 / 5)
    extreme = t([[500.0, -400.0]])
    for name in registry.ROLLOUT_CORRECTIONS.names():
        k, _ = RC.rejection_mask(extreme, torch.ones(1, 2, dtype=F64), [name], [2.0])
        assert k.sum() == 0, name


def test_batch_mean_weight_token_and_sequence():
    w = t([[1.0, 3.0, 9.0], [2.0, 2.0, 0.0], [5.0, 5.0, 5.0]])
    m = t([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    assert RC.batch_mean_weight(w, m, "token").item() == pytest.approx(2.0)
    assert RC.batch_mean_weight(w, m, "sequence").item() == pytest.approx((2.0 + 2.0) / 2)
    assert RC.batch_mean_weight(w, torch.zeros_like(m), "token").item() == 1.0, "nothing valid: unscaled"
    assert RC.batch_mean_weight(torch.zeros_like(w), m, "token").item() == 1.0
    # After dividing, the loss's weights over the batch have mean 1.
    alg = AlgorithmConfig(loss="tis", is_cap=5.0)
    prox, behav = torch.log(t([[0.5, 0.9, 0.2]])), torch.log(t([[0.25, 0.9, 0.8]]))
    wt, level = L.is_weight_at_prox(alg, prox, behav, torch.ones(1, 3, dtype=F64))
    assert level == "token" and torch.allclose(wt, t([[2.0, 1.0, 0.25]]))
    scale = RC.batch_mean_weight(wt, torch.ones(1, 3, dtype=F64), level)
    assert (wt / scale).mean().item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="algorithm.is_normalize needs a loss with a behaviour IS weight"):
        L.is_weight_at_prox(AlgorithmConfig(loss="cispo"), prox, behav, torch.ones(1, 3))
