"""The learner on fixed trajectory groups (no generators): every loss / advantage / KL switch trains,
the reference stays the frozen initial model, and world size 2 makes the same update as world size 1."""

import json
import subprocess
import sys

import pytest
import torch

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import ensure_groups
from tests.helpers import fixed_groups


def run_learner(tmp_path, tiny_model, name, overrides, steps=3, groups_per_step=4, timeout=600, groups=None):
    redis = LocalRedis(tmp_path / f"redis-{name}").start()
    try:
        cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"run.max_steps={steps}",
                                 f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                                 f"learner.batch_groups={groups_per_step}", "algorithm.max_staleness=1000",
                                 "learner.lr=1e-3", *overrides])
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_yaml(cfg))
        client, keys = connect(redis.url), Keys(name)
        ensure_groups(client, keys)
        for g in groups or fixed_groups(steps * groups_per_step * 2):
            client.xadd(keys.trajectories, {"data": schema.encode(g)})
        with open(tmp_path / f"{name}.log", "w") as log:
            code = subprocess.run([sys.executable, "-m", "asyncrl", "learner", str(path)], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout).returncode
        assert code == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        return cfg, rows
    finally:
        redis.stop()


VARIANTS = {
    "gspo_rloo": ["algorithm.loss=gspo", "algorithm.advantage=rloo"],
    # With the one-GPU switches: one FSDP unit, no resharding, logits kept for the backward.
    "cispo_reinforcepp": ["algorithm.loss=cispo", "algorithm.advantage=reinforce_pp", "learner.shard_layers=false",
                          "learner.reshard_after_forward=false", "learner.keep_logits_gb=1"],
    # With IS normalisation; tis also with sequence-level rejection sampling (a bound that random
    # behaviour log-probs pass: the statistics are what is checked here, the rejection itself in
    # tests/test_rollout_correction_run.py and the loss tests).
    "mis_drgrpo": ["algorithm.loss=mis", "algorithm.advantage=dr_grpo", "algorithm.aggregation=seq_mean_token_sum",
                   "algorithm.is_normalize=true"],
    "tis_rppbaseline": ["algorithm.loss=tis", "algorithm.advantage=reinforce_pp_baseline",
                        "algorithm.rollout_rs=[seq_max_k2]", "algorithm.rollout_rs_threshold=[50.0]",
                        "algorithm.is_normalize=true", "algorithm.entropy_coef=0.01"],
    "ppo_dualclip_kl_loss_adaptive": ["algorithm.loss=ppo", "algorithm.dual_clip=3.0", "algorithm.kl_coef=0.05",
                                      "algorithm.kl_estimator=k3", "algorithm.kl_target=0.01",
                                      "learner.ppo_epochs=2", "learner.lr_schedule=cosine", "learner.warmup_steps=2"],
    "seq_tis_kl_reward_dapo": ["algorithm.is_level=sequence", "algorithm.kl_coef=0.1", "algorithm.kl_in=reward",
                               "algorithm.kl_estimator=k1", "algorithm.dynamic_sampling=true",
                               "algorithm.overlong_buffer=4", "algorithm.clip_high=0.28",
                               "learner.activation_checkpointing=true"],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_every_algorithm_switch_trains(tmp_path, tiny_model, name):
    from transformers import AutoModelForCausalLM

    dapo = "algorithm.dynamic_sampling=true" in VARIANTS[name]
    groups = fixed_groups(24)
    if dapo:  # every third group has all-equal rewards: dynamic sampling must drop (and count) them
        for g in groups[1::3]:
            for smp in g.samples:
                smp.reward = 1.0
    flat = [i for i, g in enumerate(groups) if len({smp.reward for smp in g.samples}) == 1]
    cfg, rows = run_learner(tmp_path, tiny_model, name, VARIANTS[name] + ["checkpoint.export_hf=true"], groups=groups)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["num_groups"] == 4 for r in rows), "every batch is full"
    if dapo:
        # 12 varied groups trained: the stream was read at least up to the 12th varied one, and every
        # flat group read on the way was dropped; at most all the flat ones were.
        twelfth = [i for i in range(len(groups)) if i not in flat][11]
        at_least = sum(1 for i in flat if i < twelfth)
        assert at_least >= 5 and at_least <= rows[-1]["dropped_zero_var"] <= len(flat), (at_least, rows)
        assert [r["dropped_zero_var"] for r in rows] == sorted(r["dropped_zero_var"] for r in rows)
    else:
        assert rows[-1]["dropped_zero_var"] == 0
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows), "the update must have a gradient"
    assert all("entropy" in r for r in rows)
    final = AutoModelForCausalLM.from_pretrained(cfg.run_dir / "hf-final")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not torch.equal(final.lm_head.weight, start.lm_head.weight), "the policy moved"
    if cfg.algorithm.kl_coef > 0:
        # The reference is the initial model, and it never changed while the policy moved.
        want = sum(float(p.double().sum()) for p in start.parameters())
        assert all(abs(r["ref_checksum"] - want) < 1e-6 * max(1.0, abs(want)) for r in rows)
        assert all(r["kl"] >= 0 or cfg.algorithm.kl_estimator == "k1" for r in rows)
        assert rows[-1]["kl"] != 0.0
    if cfg.learner.lr_schedule == "cosine":
        assert rows[0]["lr"] < rows[1]["lr"], "warm-up raises the learning rate"
    if cfg.algorithm.kl_target:
        assert rows[-1]["kl_coef"] != rows[0]["kl_coef"], "the adaptive controller moved"
    # The off-policy diagnostics of every step, and those of the corrections switched on.
    assert all(r["ess"] > 0 and r["is_weight_mean"] > 0 for r in rows)
    if cfg.algorithm.is_normalize:
        assert all(r["is_norm_factor"] > 0 for r in rows)
        # The normaliser is the batch mean of the loss's IS weight: it moves with the data.
        assert len({round(r["is_norm_factor"], 9) for r in rows}) > 1
    if cfg.algorithm.rollout_rs:
        assert all(0 <= r["rs_token_reject_frac"] <= 1 and 0 <= r["rs_seq_reject_frac"] <= 1 for r in rows)
    else:
        assert "rs_token_reject_frac" not in rows[0]
    if cfg.algorithm.loss == "mis":
        assert all(0 <= r["masked_frac"] <= 1 for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["reinforce_pp"])
def test_world_size_2_makes_the_same_update_as_world_size_1(tmp_path, tiny_model, advantage):
    """reinforce_pp: whitened over the whole batch, so the ranks must sum its moments
    (asyncrl/algorithms/advantages.py whiten); a group-local baseline (grpo) needs nothing of the
    other rank and is the simpler case. The loss, the gradient norm and every weight agree."""
    from safetensors.torch import load_file

    common = ["checkpoint.export_hf=true", f"algorithm.advantage={advantage}"]
    cfg1, rows1 = run_learner(tmp_path, tiny_model, "ws1", ["learner.nproc=1", *common])
    cfg2, rows2 = run_learner(tmp_path, tiny_model, "ws2", ["learner.nproc=2", *common])
    for a, b in zip(rows1, rows2, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * max(1.0, a["grad_norm"])
    w1 = load_file(str(cfg1.run_dir / "hf-final" / "model.safetensors"))
    w2 = load_file(str(cfg2.run_dir / "hf-final" / "model.safetensors"))
    assert w1.keys() == w2.keys()
    # A key projection's bias shifts every score of a query by the same amount, which the softmax
    # cancels: its gradient is zero up to rounding, and Adam turns that rounding into steps of size
    # lr whatever the split of the batch. Every other parameter must agree.
    differ = [k for k in w1 if not k.endswith("k_proj.bias") and not torch.allclose(w1[k], w2[k], atol=1e-5)]
    assert not differ, differ
