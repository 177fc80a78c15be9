"""algorithm.max_staleness=auto: the config, the controller's rules, the simulator proof in small, and
the bound reaching the buffer's admission and the learner's filter through real Redis."""

from dataclasses import replace

import numpy as np
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.control import FleetAdvisor, StalenessController, StepSignals, fleet_request
from asyncrl.modes import admission_staleness
from asyncrl.protocol import schema
from asyncrl.tools.simulate import SimConfig, simulate
from benchmarks.autotune_sim import base_config, compare


def _sig(wait_s=0.0, busy_s=1.0, backlog=0, gens=2, ess=None, capped=None):
    return StepSignals(wait_s=wait_s, busy_s=busy_s, backlog=backlog, batch_groups=8, num_generators=gens,
                       ess=ess, capped_frac=capped)


def test_auto_turns_autotune_on_and_holds_its_max():
    cfg = load_config(None, ["algorithm.max_staleness=auto", "algorithm.autotune.max=5"])
    assert cfg.algorithm.autotune.enabled and cfg.algorithm.max_staleness == 5
    fixed = load_config(None, ["algorithm.max_staleness=3"])
    assert not fixed.algorithm.autotune.enabled and fixed.algorithm.max_staleness == 3
    assert admission_staleness(fixed, b"7") == 3  # a fixed bound ignores the learner's hash
    assert admission_staleness(cfg, None) == 1 and admission_staleness(cfg, b"4") == 4
    assert admission_staleness(cfg, b"9") == 5  # kept within the limits


@pytest.mark.parametrize("overrides, says", [
    (["algorithm.max_staleness=auto", "algorithm.autotune.min=9"], "algorithm.autotune.min (9) must be <="),
    (["algorithm.max_staleness=often"], "algorithm.max_staleness"),
    (["algorithm.autotune.fleet_min=4", "algorithm.autotune.fleet_max=2"], "fleet_min (4) must be <="),
    # the bound in force may fall to the min: pushes every 3 steps need a min of at least 2
    (["algorithm.max_staleness=auto", "algorithm.autotune.min=1", "weights.sync_every=3"],
     "weights.sync_every=3 needs algorithm.max_staleness >= 2 (got 1)"),
    (["algorithm.max_staleness=auto", "run.mode=sync"], "max_staleness=auto has nothing to tune there"),
])
def test_bad_limits_are_refused_with_the_path(overrides, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_the_bound_rises_while_the_learner_waits_and_stays_within_max():
    c = StalenessController(1, 3, patience=2)
    for _ in range(200):
        c.observe(_sig(wait_s=4.0 - c.bound, busy_s=1.0))  # each rise shortens the wait
    assert c.bound == 3 and c.num_direction_changes == 0
    assert all(ch.new == ch.old + 1 and "learner waited" in ch.reason for ch in c.changes)


def test_no_wait_no_move():
    c = StalenessController(1, 8)
    for _ in range(100):
        assert c.observe(_sig(wait_s=0.01, busy_s=1.0)) is None
    assert c.bound == 1


def test_a_rise_that_does_not_shorten_the_wait_is_taken_back_once():
    c = StalenessController(1, 8, patience=2)
    for _ in range(300):
        c.observe(_sig(wait_s=5.0, busy_s=1.0))  # the wait never falls: more in flight does not help
    assert [(ch.old, ch.new) for ch in c.changes] == [(1, 2), (2, 1)]
    assert "did not shorten" in c.changes[-1].reason and c.bound == 1
    for _ in range(6):  # a new fleet: the bound may be tried again
        c.observe(_sig(wait_s=5.0, busy_s=1.0, gens=4))
    assert c.bound == 2


def test_the_off_policy_guard_pulls_the_bound_back_and_the_filter_keeps_released_groups():
    c = StalenessController(1, 8, patience=2, ess_floor=0.8, relax_steps=50)
    c.bound = 4
    c.observe(_sig())
    for _ in range(2):
        change = c.observe(_sig(ess=0.5))
    assert change is not None and change.new == 3 and "ess 0.500 < 0.8" in change.reason
    assert c.filter_bound == 4  # groups released under 4 are still trained
    for _ in range(10):
        c.observe(_sig(capped=0.2))
    assert c.bound < 3 and all(ch.new < ch.old for ch in c.changes)
    for _ in range(c.hi + 1):
        c.observe(_sig())
    assert c.filter_bound == c.bound


def test_fleet_advice_counts_the_generators_that_remove_the_wait():
    a = FleetAdvisor()
    # 2 generators; the learner waits 3 s and works 1 s a step: 8 generators would keep up.
    assert a.observe(_sig(wait_s=3.0, busy_s=1.0, backlog=8, gens=2), bound_capped=False) == 8
    assert FleetAdvisor().observe(_sig(wait_s=0.0, busy_s=1.0, gens=2), bound_capped=True) == 2
    assert fleet_request(8, 2, 1, 4) == 2 and fleet_request(1, 2, 2, 4) == 0


def test_multi_version_share_of_a_step():
    from learners.autotune import multi_version_frac

    def sample(versions):
        n = len(versions)
        return schema.Sample(completion_ids=schema.pack_i32(np.arange(n)), logprobs=schema.pack_f32(np.zeros(n)),
                             versions=schema.pack_i32(np.array(versions)), reward=0.0)

    group = schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id="g", prompt_id="p",
                                   generator_id="gen", prompt_ids=schema.pack_i32(np.arange(2)),
                                   samples=[sample([3, 3, 4, 4]), sample([4] * 6)],
                                   sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=0.0)
    assert multi_version_frac([group]) == 0.4  # 4 of 10 tokens


@pytest.mark.parametrize("gens, sigma", [(1, 0.0), (1, 1.0), (4, 1.0)])
def test_in_the_simulator_auto_reaches_the_best_fixed_bound_without_oscillating(gens, sigma):
    """A small version of benchmarks/autotune_sim.py. Not every case meets 10%: with uniform lengths
    and 4 generators the rise from 6 to 7 is judged on a transient and taken back (0.89 of the best
    fixed bound in the full benchmark, docs/staleness.md)."""
    r = compare(base_config(gens, sigma, steps=220), fixed=(1, 2, 4, 8))
    assert r["auto_vs_best"] >= 0.9, r["fixed_tokens_per_s"]
    assert r["auto_direction_changes"] <= 1  # at most one rise taken back, never back and forth


def test_in_the_simulator_the_guard_holds_the_lag_down():
    base = replace(base_config(4, 1.0, steps=150), ess_drift=0.1)
    free = simulate(replace(base, autotune=1, ess_drift=0.0))
    guarded = simulate(replace(base, autotune=1))
    assert any("off-policy guard" in ch["reason"] for ch in guarded.changes)
    assert guarded.lag_mean < free.lag_mean and max(guarded.bounds[-20:]) < max(free.bounds)


def test_simulator_with_a_fixed_bound_is_unchanged_by_the_controller_fields():
    cfg = SimConfig(num_generators=2, len_sigma=1.0, steps=20, max_staleness=2)
    r = simulate(cfg)
    assert set(r.bounds) == {2} and r.changes == [] and r.lag_max <= 2


def test_the_buffer_admits_by_the_bound_the_learner_publishes(redis_server):
    """Real Redis: the learner's side writes `staleness_bound` into the `learner` hash and sets the
    reader's filter; the buffer's admission budget follows the published bound under auto only."""
    from asyncrl.protocol.keys import Keys, connect
    from buffers.prompts import PromptFeed
    from learners.autotune import AutoTune
    from learners.reader import TrajectoryReader

    client, keys = connect(redis_server.url), Keys("auto")
    cfg = load_config(None, ["algorithm.max_staleness=auto", "algorithm.autotune.min=2", "algorithm.autotune.max=5"])
    reader = TrajectoryReader(client, keys, cfg)
    tune = AutoTune(cfg, client, keys, reader)
    assert client.hget(keys.learner, "staleness_bound") == b"2" and reader.max_staleness == 2
    feed = PromptFeed(cfg, client, keys, rows=[], counters=None)
    per_step = cfg.learner.batch_groups
    assert feed._budget(0, 0, 0, client.hget(keys.learner, "staleness_bound")) == 3 * per_step
    client.hset(keys.learner, "staleness_bound", 4)  # as after two rises
    assert feed._budget(0, 0, 0, client.hget(keys.learner, "staleness_bound")) == 5 * per_step
    fixed = load_config(None, ["algorithm.max_staleness=1"])
    assert PromptFeed(fixed, client, keys, rows=[], counters=None)._budget(0, 0, 0, b"4") == 2 * per_step
    row = tune.on_step([], {"step_s": 1.0}, 0.0, 1, 0.0)
    assert row["staleness_bound"] == 2.0 and row["fleet_advice_generators"] == 1.0


def test_a_resumed_controller_goes_on_from_the_published_bound_within_its_limits():
    from asyncrl.control import StalenessController

    c = StalenessController(1, 4)
    c.resume_at(3)
    assert (c.bound, c.filter_bound) == (3, 3)
    c.resume_at(9)
    assert c.bound == 4
    c.resume_at(None)  # nothing published: the min, as a fresh run
    assert c.bound == 4
    fresh = StalenessController(1, 4)
    fresh.resume_at(None)
    assert fresh.bound == 1
