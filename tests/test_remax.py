"""ReMax (algorithm.advantage=remax): the estimator against hand-computed values, the group's greedy
baseline on the wire (decoded, refused when not finite or missing), the generator's greedy
completion beside the samples, the learner's quarantine of a group without a baseline, and a real
run (redis-server, buffer, vLLM CPU generator, torchrun learner) whose groups all carried one."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from asyncrl.algorithms.advantages import AdvantageInputs, estimate, remax
from asyncrl.config import AlgorithmConfig, ConfigError, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups
from generators.engines import SampleOut
from tests.buffer_support import push, start_thread, wait_for
from tests.helpers import fixed_groups, make_group
from tests.test_learner_variants import run_learner

REPO = Path(__file__).resolve().parent.parent
VOCAB = 128  # the tiny model's

F64 = torch.float64


def _with_baseline(group: schema.TrajectoryGroup, baseline: float | None) -> schema.TrajectoryGroup:
    group.baseline_reward = baseline
    return group


# ---- the estimator ---------------------------------------------------------------------------------


def test_remax_is_reward_minus_greedy_reward_on_valid_tokens_only():
    # Two groups of three; lengths 3, 1, 0 (an empty completion: all padding) and 2, 3, 3.
    scores = torch.tensor([[1.0, 0.0, 0.75], [0.2, 0.9, 0.5]], dtype=F64)
    baselines = torch.tensor([0.5, 0.5], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=F64)
    expected = torch.tensor([[0.5, 0.5, 0.5], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0],
                             [-0.3, -0.3, 0.0], [0.4, 0.4, 0.4], [0.0, 0.0, 0.0]], dtype=F64)
    x = AdvantageInputs(scores, mask, AlgorithmConfig(advantage="remax"), baselines_G=baselines)
    adv, returns = estimate(x)
    assert returns is None
    assert adv.dtype == F64
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_remax_with_a_per_token_kl_penalty_subtracts_it_from_the_return_to_go():
    # verl's form: reverse cumsum of token rewards (outcome on the last token, -kl on each) minus b.
    scores_B = torch.tensor([1.0, 0.0], dtype=F64)
    baselines_B = torch.tensor([0.25, 0.25], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.05, 0.4, 9.0]], dtype=F64)  # 9.0 sits on padding
    expected = torch.tensor([[1 - 0.6 - 0.25, 1 - 0.5 - 0.25, 1 - 0.3 - 0.25],
                             [0 - 0.45 - 0.25, 0 - 0.4 - 0.25, 0.0]], dtype=F64)
    torch.testing.assert_close(remax(scores_B, baselines_B, mask, kl), expected, rtol=0, atol=1e-12)


def test_remax_gives_zero_advantages_where_every_sample_scores_the_greedy_reward():
    scores = torch.tensor([[0.7, 0.7, 0.7, 0.7]], dtype=F64)
    mask = torch.ones(4, 5, dtype=F64)
    x = AdvantageInputs(scores, mask, AlgorithmConfig(advantage="remax"),
                        baselines_G=torch.tensor([0.7], dtype=F64))
    adv, _ = estimate(x)
    assert torch.equal(adv, torch.zeros(4, 5, dtype=F64))


def test_remax_works_with_one_sample_per_group():
    scores = torch.tensor([[1.0], [0.0], [0.5]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]], dtype=F64)
    x = AdvantageInputs(scores, mask, AlgorithmConfig(advantage="remax"),
                        baselines_G=torch.tensor([0.0, 1.0, 0.5], dtype=F64))
    adv, _ = estimate(x)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.0, 0.0]], dtype=F64), rtol=0, atol=0)


# ---- config -----------------------------------------------------------------------------------------


def test_remax_is_an_allowed_advantage_that_accepts_one_sample_and_refuses_overlong_shaping():
    assert load_config(None, ["algorithm.advantage=remax", "generator.n=1"]).generator.n == 1
    with pytest.raises(ConfigError, match=r"generator.n must be > 1 .*rloo"):
        load_config(None, ["algorithm.advantage=rloo", "generator.n=1"])
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer=4 .*set algorithm.overlong_buffer=0"):
        load_config(None, ["algorithm.advantage=remax", "algorithm.overlong_buffer=4"])


# ---- the wire ---------------------------------------------------------------------------------------


def test_group_round_trips_with_and_without_a_baseline_and_frames_without_the_field_decode():
    with_b = schema.decode(schema.encode(_with_baseline(make_group("p1@e0"), 0.625)), schema.TrajectoryGroup)
    assert with_b.baseline_reward == 0.625 and len(with_b.samples) == 4
    without = schema.decode(schema.encode(make_group("p1@e0")), schema.TrajectoryGroup)
    assert without.baseline_reward is None
    # A frame written before the field existed (no key at all) decodes, with no baseline.
    old = msgspec.to_builtins(make_group("p1@e0"), builtin_types=(bytes,))
    del old["baseline_reward"]
    assert schema.decode(msgspec.msgpack.encode(old), schema.TrajectoryGroup).baseline_reward is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_baseline_is_refused(bad):
    with pytest.raises(schema.FrameError) as e:
        schema.decode(schema.encode(_with_baseline(make_group("p1@e0"), bad)), schema.TrajectoryGroup)
    assert e.value.reason == "bad_baseline"


def test_a_missing_baseline_is_refused_only_when_the_run_needs_one(make_cfg):
    remax_limits = schema.RunLimits.from_config(make_cfg("algorithm.advantage=remax"), VOCAB)
    grpo_limits = schema.RunLimits.from_config(make_cfg(), VOCAB)
    assert remax_limits.needs_baseline and not grpo_limits.needs_baseline
    with pytest.raises(schema.FrameError) as e:
        schema.validate_for_run(make_group("p1@e0"), remax_limits)
    assert e.value.reason == "no_baseline"
    schema.validate_for_run(_with_baseline(make_group("p1@e0"), 0.5), remax_limits)
    schema.validate_for_run(make_group("p1@e0"), grpo_limits)
    schema.validate_for_run(_with_baseline(make_group("p1@e0"), 0.5), grpo_limits)  # carried, unused


def test_buffer_refuses_non_finite_and_missing_baselines_with_counted_reasons(make_cfg, redis_server):
    cfg = make_cfg("run.name=rmxbuf", "algorithm.advantage=remax", "learner.batch_groups=2", redis=redis_server)
    svc, t = start_thread(cfg)
    try:
        assert wait_for(lambda: svc.client.xlen(svc.keys.prompts) > 0)
        gid = schema.decode(svc.client.xrange(svc.keys.prompts)[0][1][b"data"], schema.PromptTask).group_id
        frames = [schema.encode(_with_baseline(make_group(gid), b)) for b in (math.nan, math.inf, None)]
        good = _with_baseline(make_group(gid), 0.25)
        push(svc.ingest_addr, frames + [schema.encode(good)])
        assert wait_for(lambda: svc.counters.get("frames", 0) == 4)
        rejects = {k[7:]: v for k, v in svc.counters.items() if k.startswith("reject:")}
        assert rejects == {"bad_baseline": 2, "no_baseline": 1}, rejects
        stored = [schema.decode(f[b"data"], schema.TrajectoryGroup) for _, f in svc.client.xrange(svc.keys.trajectories)]
        assert [(s.group_id, s.baseline_reward) for s in stored] == [(gid, 0.25)]
        svc.publish_metrics()
        assert int(svc.client.hget(svc.keys.metrics, "buffer:reject:bad_baseline")) == 2
    finally:
        svc.stop()
        t.join(10)


# ---- the learner's quarantine -----------------------------------------------------------------------


def test_learner_quarantine_moves_a_group_without_a_baseline_aside_under_remax(make_cfg, redis_server):
    from learners.quarantine import Quarantine

    cfg = make_cfg("run.name=rmxq", "algorithm.advantage=remax", redis=redis_server)
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    groups = [_with_baseline(make_group("p1@e0"), 0.5), make_group("p2@e0"), _with_baseline(make_group("p3@e0"), 1.0)]
    for g in groups:
        client.xadd(keys.trajectories, {"data": schema.encode(g)})
    delivered = client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"}, count=10)[0][1]
    pairs = [(e, schema.decode(f[b"data"], schema.TrajectoryGroup)) for e, f in delivered]
    screen = Quarantine(client, keys, schema.RunLimits.from_config(cfg, VOCAB))
    kept = screen.screen(pairs)
    assert [g.group_id for _, g in kept] == ["p1@e0", "p3@e0"]
    dead = client.xrange(keys.quarantine)
    assert [(f[b"group_id"], f[b"reason"]) for _, f in dead] == [(b"p2@e0", b"no_baseline")]
    assert schema.decode(dead[0][1][b"data"], schema.TrajectoryGroup).baseline_reward is None
    assert int(client.hget(keys.learner, "quarantined")) == 1 and screen.num == 1
    assert int(client.xpending(keys.trajectories, LEARNER_GROUP)["pending"]) == 2  # the kept two, not acked yet
    # Under another estimator the same group is trainable.
    assert len(Quarantine(client, keys, schema.RunLimits.from_config(make_cfg(), VOCAB)).screen(pairs)) == 3


@pytest.mark.slow
def test_remax_learner_trains_one_sample_groups_and_quarantines_those_without_a_baseline(tmp_path, tiny_model):
    steps, per_step = 3, 4
    groups = fixed_groups(steps * per_step + 3, seed=3, n=1)
    missing = {1, 4, 6}  # among the first groups read
    for i, g in enumerate(groups):
        g.baseline_reward = None if i in missing else 0.5
    _, rows = run_learner(tmp_path, tiny_model, "rmxl", ["algorithm.advantage=remax", "generator.n=1",
                                                         "checkpoint.export_hf=false"],
                          steps=steps, groups_per_step=per_step, groups=groups)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["num_groups"] == per_step for r in rows)
    assert rows[-1]["quarantined"] == len(missing)
    assert all(r["baseline_reward_mean"] == 0.5 for r in rows)
    # Rewards are 0 or 1 against a baseline of 0.5: every token has an advantage of +-0.5.
    assert all(r["grad_norm"] > 0 for r in rows)


# ---- the generator's greedy completion --------------------------------------------------------------


class _ScriptedEngine:
    """Stands in for vLLM: fixed completions, and a record of every generate_group call."""

    num_workers = 1

    def __init__(self, sampled: list[list[int]], greedy: list[int]):
        self.sampled, self.greedy = sampled, greedy
        self.calls: list[tuple[int, float | None]] = []

    async def generate_group(self, prompt_ids, n, version, temperature=None):
        self.calls.append((n, temperature))
        rows = [self.greedy] if temperature == 0.0 else self.sampled[:n]
        return [SampleOut(list(r), [-0.5] * len(r), [version()] * len(r), "length") for r in rows]

    async def join(self, epoch_frame, generator_id, timeout_s):
        return True

    async def update_weights(self, announcement_frame, mode, timeout_s):
        return {"checksums": [], "pause_s": 0.0}

    async def idle(self):
        pass

    def shutdown(self):
        pass


class _RecordingOutbox:
    def __init__(self):
        self.frames: list[bytes] = []

    def put(self, group_id, entry_id, frame):
        self.frames.append(frame)


@pytest.mark.parametrize("advantage", ["remax", "grpo"])
def test_generator_scores_one_greedy_completion_as_the_baseline_and_does_not_train_on_it(make_cfg, tiny_model,
                                                                                        advantage):
    from transformers import AutoTokenizer

    from asyncrl.tasks.rewards import build_reward
    from generators.engines import Engine
    from generators.main import Generator

    cfg = make_cfg(f"algorithm.advantage={advantage}", "generator.n=2")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    answer = "abc"
    sampled = [tok.encode("abx", add_special_tokens=False), tok.encode("zzz", add_special_tokens=False)]
    greedy = tok.encode("abc", add_special_tokens=False)
    engine = _ScriptedEngine(sampled, greedy)
    assert isinstance(engine, Engine)
    gen = Generator(cfg, "g0", engine=engine)
    gen.tokenizer, gen.outbox, gen.version = tok, _RecordingOutbox(), 3
    task = schema.PromptTask(schema_version=schema.SCHEMA_VERSION, group_id="p7@e0", prompt_id="p7", prompt="abc",
                             answer=answer, released_at=1.0)
    try:
        asyncio.run(gen.process(b"1-0", task))
    finally:
        gen.rewards.shutdown()
    (frame,) = gen.outbox.frames
    group = schema.decode(frame, schema.TrajectoryGroup)
    assert [schema.unpack_i32(s.completion_ids).tolist() for s in group.samples] == sampled  # not the greedy one
    assert gen.tokens == sum(map(len, sampled))
    reward = build_reward(cfg.reward)
    if advantage == "remax":
        assert sorted(engine.calls, key=str) == sorted([(2, None), (1, 0.0)], key=str)
        assert group.baseline_reward == float(reward(tok.decode(greedy, skip_special_tokens=True), answer))
        assert group.baseline_reward > max(s.reward for s in group.samples)  # the copy is exact
        assert gen.baseline_tokens == len(greedy)
    else:
        assert engine.calls == [(2, None)]
        assert group.baseline_reward is None and gen.baseline_tokens == 0


# ---- a real run -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_remax_run_finishes_and_every_group_carried_a_greedy_baseline(tmp_path, tiny_model):
    steps, n = 3, 4
    with LocalRedis(tmp_path / "redis") as redis:
        argv = [sys.executable, "-m", "asyncrl", "run", str(REPO / "configs" / "tiny.yaml"),
                "algorithm.advantage=remax", f"run.max_steps={steps}", f"run.dir={tmp_path / 'runs'}",
                "run.name=remax", f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                f"generator.n={n}", "learner.batch_groups=4", "generator.kv_cache_gb=0.5"]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=540, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert sum(1 for line in r.stdout.splitlines() if line.startswith("step=")) == steps
        rows = [json.loads(line) for line in (tmp_path / "runs" / "remax" / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == list(range(1, steps + 1))
        for row in rows:
            assert 0.0 <= row["baseline_reward_mean"] <= 1.0  # the copy reward's range
            assert row["quarantined"] == 0 and row["num_groups"] == 4
        client, keys = connect(redis.url), Keys("remax")
        stored = [schema.decode(f[b"data"], schema.TrajectoryGroup) for _, f in client.xrange(keys.trajectories)]
        assert len(stored) >= steps * 4
        assert all(g.baseline_reward is not None and 0.0 <= g.baseline_reward <= 1.0 for g in stored)
        assert all(len(g.samples) == n for g in stored)  # the greedy completion is not a sample
        assert client.xlen(keys.quarantine) == 0
