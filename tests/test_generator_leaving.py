"""SIGTERM ends a real `asyncrl generator` process (HF engine backend) within
generator.drain_timeout_s + LEAVE_MARGIN_S, Redis up or down: a real redis-server killed or frozen
(SIGSTOP) under the generator, a real buffer process, and the test playing the learner (the
generator has joined its weight group, which the test never re-forms without it)."""

import os
import signal
import sys
import time

import pytest

from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol.keys import PROMPT_GROUP
from generators.leave import LEAVE_MARGIN_S
from tests.buffer_support import wait_for
from tests.gen_support import perturbed_state
from tests.test_generator_process import _gen_info, _learner_side, _push_v1
from tests.test_leaving import _end_outage, _group_gone, _outage, _sigterm_and_time

DRAIN_S = 2.0
BOUND_S = DRAIN_S + LEAVE_MARGIN_S


def _generating(make_cfg, redis, tmp_path, tiny_model, name):
    """A generator at version 1, member of the weight group, with groups pushed and more in flight."""
    cfg_path, keys, client, buffer, procs = _learner_side(
        make_cfg, redis, tmp_path, name, "generator.backend=hf", "generator.max_tokens=16",
        "generator.max_concurrent_groups=2", f"generator.drain_timeout_s={DRAIN_S}", "weights.join_timeout_s=60",
        "learner.batch_groups=64")
    proc = procs.spawn("g0", [sys.executable, "-m", "asyncrl", "generator", str(cfg_path), "--id", "g0"])
    try:
        assert wait_for(lambda: _gen_info(client, keys, "g0").get("state") == "waiting_weights", 180, 0.2), \
            procs.log("g0")[-3000:]
        _push_v1(client, keys, perturbed_state(tiny_model, 1), member="g0.0")
        assert wait_for(lambda: client.xlen(keys.trajectories) >= 2, 120, 0.1), procs.log("g0")[-3000:]
    except BaseException:
        procs.close()
        buffer.stop()
        raise
    return keys, client, buffer, procs, proc


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_generator_sigterm_during_a_redis_outage_is_gone_within_its_bound(make_cfg, tmp_path, tiny_model, how):
    redis = LocalRedis(tmp_path / "redis").start()
    keys, client, buffer, procs, proc = _generating(make_cfg, redis, tmp_path, tiny_model, f"gl-{how}")
    try:
        _outage(redis, how)
        time.sleep(1.5)  # the generator's Redis calls are inside their retry loop now
        elapsed = _sigterm_and_time(proc, BOUND_S)
        log = procs.log("g0")
        print(f"generator leave with Redis {how}: {elapsed:.1f}s (bound {BOUND_S:.0f}s), exit {proc.returncode}")
        assert elapsed < BOUND_S, f"left {elapsed:.1f}s after SIGTERM: {log[-3000:]}"
        assert proc.returncode == 0, log[-3000:]  # it left by itself, within its bound
        assert "Traceback" not in log, log[-3000:]
        assert "left without Redis" in log, log[-3000:]  # the one line on what the reclaimer gets
        assert _group_gone(proc.pid), "nothing of the generator is left behind"
    finally:
        procs.close()
        if redis.proc.poll() is None:
            os.kill(redis.proc.pid, signal.SIGCONT)
        buffer.stop()
        _end_outage(redis)


@pytest.mark.slow
def test_generator_sigterm_with_redis_up_is_gone_within_its_bound(make_cfg, redis_server, tmp_path, tiny_model):
    """The learner never re-forms the weight group without it (weights.join_timeout_s=60): the
    weight-group leave is cut at the bound, the rest of the leave happens as usual."""
    keys, client, buffer, procs, proc = _generating(make_cfg, redis_server, tmp_path, tiny_model, "gl-up")
    try:
        elapsed = _sigterm_and_time(proc, BOUND_S)
        log = procs.log("g0")
        print(f"generator leave with Redis up: {elapsed:.1f}s (bound {BOUND_S:.0f}s), exit {proc.returncode}")
        assert elapsed < BOUND_S, f"left {elapsed:.1f}s after SIGTERM: {log[-3000:]}"
        assert proc.returncode == 0, log[-3000:]
        assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
        assert not client.exists(keys.gen("g0"))
        events = [f[b"kind"].decode() for _, f in client.xrange(keys.events)]
        assert "generator_leave" in events
        pending = client.xpending_range(keys.prompts, PROMPT_GROUP, min="-", max="+", count=1000, consumername="g0")
        assert pending == [], "the generator left holding leases"
        assert _group_gone(proc.pid)
    finally:
        procs.close()
        buffer.stop()
