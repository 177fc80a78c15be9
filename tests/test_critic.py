"""The critic for algorithm.advantage=gae (learners/critic.py): values line up with the completion
tokens, GAE advantages and returns come out as computed by hand, the value loss goes down, a learner
trains with it at generator.n=1 (world size 2), and a resumed learner continues with the critic it had saved."""

import json
import subprocess
import sys

import pytest
import torch

from asyncrl.config import ConfigError, dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups
from learners import packing
from learners.batch import build_batch, build_step
from learners.critic import critic_update, load_value_model, old_values, values_BT
from learners.step import batch_targets
from tests.helpers import fixed_groups, make_group


def test_gae_needs_no_groups_but_group_advantages_do():
    cfg = load_config(None, ["algorithm.advantage=gae", "generator.n=1"])
    assert cfg.generator.n == 1
    with pytest.raises(ConfigError, match=r"generator.n must be > 1 for group advantages.*advantage=gae"):
        load_config(None, ["generator.n=1"])
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling"):
        load_config(None, ["algorithm.advantage=gae", "generator.n=1", "algorithm.dynamic_sampling=true"])


def test_gae_wiring_by_hand(tiny_model):
    """One sample of 3 completion tokens after a 3-token prompt: L = 6, T = 5, the completion's
    targets at positions 2..4. Values 0.1, 0.5, 0.3 there, reward 1, gamma 1, lambda 0.5:
    deltas 0.4, -0.2, 0.7 -> advantages 0.475, 0.15, 0.7 -> returns 0.575, 0.65, 1.0."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, ["algorithm.advantage=gae", "generator.n=1", "algorithm.lam=0.5"])
    batch = build_batch([make_group(num_samples=1, num_tokens=3, reward=1.0)], pad_id=0, device="cpu")
    assert batch.loss_mask_BT.tolist() == [[0, 0, 1, 1, 1]]
    critic = load_value_model(tiny_model)
    v = values_BT(critic, batch)
    assert v.shape == batch.loss_mask_BT.shape and v[0, :2].abs().sum() == 0, "values only on completion tokens"
    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    step = build_step([make_group(num_samples=1, num_tokens=3, reward=1.0)], "cpu")
    t = batch_targets(policy, step, _plan(step, cfg), cfg, values_N=torch.tensor([0.1, 0.5, 0.3]))
    assert t.returns_N.shape == t.adv_N.shape == (3,)
    assert torch.allclose(t.returns_N, torch.tensor([0.575, 0.65, 1.0]), atol=1e-6)
    raw = torch.tensor([0.475, 0.15, 0.7])
    assert torch.allclose(t.adv_N, (raw - raw.mean()) / (raw.std() + 1e-6), atol=1e-5), "whitened"


def _plan(step, cfg, budget=4096):
    return packing.plan_step(step.group_sizes, step.lengths, step.comp_len, world=1,
                             minibatches=cfg.learner.minibatches, epochs=cfg.learner.ppo_epochs, budget=budget,
                             packed=cfg.learner.packing, seed=0)


def test_value_loss_goes_down_on_a_fixed_batch(tiny_model):
    """The learner's loop on one batch: old values, then the clipped value update; lambda = 1 makes
    the returns the plain rewards, so this is regression and the loss must fall."""
    torch.manual_seed(0)
    cfg = load_config(None, ["algorithm.advantage=gae", "algorithm.lam=1.0", "learner.critic_lr=3e-3"])
    step = build_step(fixed_groups(4, seed=5), "cpu")
    plan = _plan(step, cfg, budget=24)  # several micro-batches
    assert plan.micro_batches(0) > 1
    critic = load_value_model(tiny_model)
    opt = torch.optim.AdamW(critic.parameters(), lr=cfg.learner.critic_lr)
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    history = []
    for _ in range(12):
        old = old_values(critic, step, plan, cfg)
        returns = batch_targets(policy, step, plan, cfg, values_N=old).returns_N
        history.append(critic_update(critic, opt, step, plan, old, returns, cfg))
    first, last = history[0], history[-1]
    assert first["value_mean"] == 0.0, "the head starts at zero"
    assert last["value_loss"] < 0.3 * first["value_loss"], [h["value_loss"] for h in history]
    assert last["value_explained_var"] > first["value_explained_var"]
    assert all(h["value_grad_norm"] > 0 for h in history)


def _start(tmp_path, tiny_model, name, overrides, groups):
    redis = LocalRedis(tmp_path / f"redis-{name}").start()
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"model.path={tiny_model}",
                             f"buffer.redis_url={redis.url}", "algorithm.max_staleness=1000", "learner.lr=1e-3",
                             *overrides])
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_yaml(cfg))
    client, keys = connect(redis.url), Keys(name)
    ensure_groups(client, keys)
    for g in groups:
        client.xadd(keys.trajectories, {"data": schema.encode(g)})
    return redis, cfg, path, client, keys


def _learn(tmp_path, path, log_name, *overrides):
    with open(tmp_path / log_name, "w") as log:
        code = subprocess.run([sys.executable, "-m", "asyncrl", "learner", str(path), *overrides], stdout=log,
                              stderr=subprocess.STDOUT, timeout=600).returncode
    assert code == 0, (tmp_path / log_name).read_text()[-3000:]
    return (tmp_path / log_name).read_text()


def _rows(cfg):
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


GAE = ["algorithm.advantage=gae", "generator.n=1", "learner.batch_groups=4", "learner.critic_lr=1e-3",
       "learner.ppo_epochs=2", "algorithm.loss=ppo"]


@pytest.mark.slow
def test_gae_learner_trains_the_critic_with_single_samples(tmp_path, tiny_model):
    # World size 2: the critic is sharded with FSDP2 like the policy.
    redis, cfg, path, _, _ = _start(tmp_path, tiny_model, "gae", [*GAE, "run.max_steps=3", "learner.nproc=2"],
                                    fixed_groups(12, seed=1, n=1))
    try:
        _learn(tmp_path, path, "gae.log")
    finally:
        redis.stop()
    rows = _rows(cfg)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for k in ("loss", "value_loss", "value_explained_var", "value_clip_frac", "value_mean", "returns_mean"):
            assert torch.isfinite(torch.tensor(r[k])), (k, r[k])
        assert r["grad_norm"] > 0 and r["value_grad_norm"] > 0
        assert 0.0 <= r["value_clip_frac"] <= 1.0
    assert rows[0]["value_mean"] == 0.0, "zero-initialised head: V = 0 before the first update"
    assert rows[-1]["value_mean"] != 0.0, "the critic was trained"
    assert rows[0]["critic_lr"] == 1e-3


@pytest.mark.slow
def test_resume_restores_critic_and_lora_adapters(tmp_path, tiny_model):
    """4 steps straight vs 2 steps, stop, resume for 2 more, with GAE, LoRA and a KL reference (the
    base with adapters off): steps 3-4 match, which they could not with a fresh critic (V = 0) or fresh
    adapters."""
    overrides = [*GAE, "run.max_steps=4", "checkpoint.every=2", "learner.lora.enabled=true",
                 "learner.lora.rank=4", "algorithm.kl_coef=0.05", "checkpoint.export_hf=false"]
    groups = fixed_groups(16, seed=2, n=1)
    redis_a, cfg_a, path_a, _, _ = _start(tmp_path, tiny_model, "straight", overrides, groups)
    redis_b, cfg_b, path_b, client_b, keys_b = _start(tmp_path, tiny_model, "resumed", overrides, groups)
    try:
        _learn(tmp_path, path_a, "a.log")
        _learn(tmp_path, path_b, "b1.log", "run.max_steps=2")
        assert int(client_b.xpending(keys_b.trajectories, LEARNER_GROUP)["pending"]) == 0
        text = _learn(tmp_path, path_b, "b2.log", "run.resume=true")
        assert "resumed from" in text and "step-000002" in text
    finally:
        redis_a.stop()
        redis_b.stop()
    want = {r["step"]: r for r in _rows(cfg_a)}
    rows = _rows(cfg_b)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert want[3]["value_mean"] != 0.0 and want[3]["kl"] != 0.0
    for r in rows[2:]:
        w = want[r["step"]]
        for k in ("loss", "value_loss", "value_mean", "kl", "critic_lr"):
            assert abs(r[k] - w[k]) < 1e-4 * max(1.0, abs(w[k])), (r["step"], k, r[k], w[k])
