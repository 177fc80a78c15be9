"""SIGTERM ends a role within its drain timeout whether Redis answers or not: a real redis-server
killed or frozen (SIGSTOP) under a real `asyncrl buffer` / `asyncrl learner` process."""

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.retry import LoudRetry
from tests.buffer_support import REPO, BufferProcess, buffer_cfg, wait_for

DRAIN_S = 4.0


def _outage(redis: LocalRedis, how: str) -> None:
    if how == "killed":
        redis.stop(kill=True)
    else:
        os.kill(redis.proc.pid, signal.SIGSTOP)


def _end_outage(redis: LocalRedis) -> None:
    if redis.proc.poll() is None:
        os.kill(redis.proc.pid, signal.SIGCONT)
    redis.stop(kill=True)


def _sigterm_and_time(proc: subprocess.Popen, limit_s: float) -> float:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=limit_s + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"still running {limit_s + 30:.0f}s after SIGTERM")
    return time.monotonic() - t0


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_leaving_process_retries_a_lost_redis_only_until_its_deadline(tmp_path):
    from asyncrl.protocol import retry

    with LocalRedis(tmp_path / "redis") as redis:
        import redis as redis_py

        client = redis_py.Redis.from_url(redis.url, socket_timeout=2, socket_connect_timeout=1,
                                         retry=LoudRetry(give_up_s=600), retry_on_error=list(retry.RETRYABLE))
        client.set("k", 1)
        redis.stop(kill=True)
        saved = retry._leave_at
        try:
            retry.leave_by(time.monotonic() + 1.0)
            t0 = time.monotonic()
            with pytest.raises(retry.RETRYABLE):
                client.get("k")
            assert time.monotonic() - t0 < 2.0, "gave up at the leave deadline, not after give_up_s"
        finally:
            retry._leave_at = saved


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_buffer_sigterm_during_a_redis_outage_exits_within_its_drain_timeout(tmp_path, how):
    redis = LocalRedis(tmp_path / "redis").start()
    cfg = buffer_cfg(tmp_path, redis, f"buffer.drain_timeout_s={DRAIN_S}", "logging.prometheus=false")
    buffer = BufferProcess(cfg, tmp_path)
    try:
        buffer.start(connect(redis.url), Keys(cfg.run.name))
        _outage(redis, how)
        time.sleep(1.5)  # the buffer is inside its retry loop now
        elapsed = _sigterm_and_time(buffer.proc, DRAIN_S)
        log = buffer.log_path.read_text()
        assert elapsed < DRAIN_S, f"left {elapsed:.1f}s after SIGTERM: {log[-2000:]}"
        assert "Traceback" not in log, log[-3000:]
        assert buffer.proc.returncode in (0, 128 + signal.SIGTERM), log[-2000:]
        assert _group_gone(buffer.proc.pid), "nothing of the buffer is left behind"
    finally:
        buffer.stop()
        _end_outage(redis)


def test_buffer_sigterm_with_redis_up_leaves_at_once_and_cleanly(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, f"buffer.drain_timeout_s={DRAIN_S}", "logging.prometheus=false")
    buffer = BufferProcess(cfg, tmp_path)
    try:
        buffer.start(connect(redis_server.url), Keys(cfg.run.name))
        elapsed = _sigterm_and_time(buffer.proc, DRAIN_S)
        log = buffer.log_path.read_text()
        assert elapsed < 2.0 and buffer.proc.returncode == 0, log[-2000:]
        assert "buffer stopped" in log and "Traceback" not in log and " ERROR " not in log, log[-2000:]
    finally:
        buffer.stop()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_learner_sigterm_during_a_redis_outage_exits_at_once(tmp_path, tiny_model, how):
    """torchrun forwards the SIGTERM to its ranks, which hold nothing to drain (an unacknowledged
    step is trained again after a restart): the whole learner is gone within a couple of seconds."""
    redis = LocalRedis(tmp_path / "redis").start()
    log_path = tmp_path / "learner.log"
    argv = [sys.executable, "-m", "asyncrl", "learner", "configs/tiny.yaml", f"model.path={tiny_model}",
            f"buffer.redis_url={redis.url}", f"run.dir={tmp_path / 'runs'}", "logging.prometheus=false"]
    with open(log_path, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # The model is built: rank 0 waits for groups from Redis.
        assert wait_for(lambda: "micro-batches of at most" in log_path.read_text() or proc.poll() is not None,
                        180, 0.2)
        assert proc.poll() is None, log_path.read_text()[-3000:]
        time.sleep(2)
        _outage(redis, how)
        time.sleep(1.5)
        elapsed = _sigterm_and_time(proc, DRAIN_S)
        log = log_path.read_text()
        assert elapsed < DRAIN_S, f"left {elapsed:.1f}s after SIGTERM: {log[-2000:]}"
        assert "Traceback" not in log, log[-3000:]
        assert _group_gone(proc.pid), "no rank of the learner is left behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        _end_outage(redis)
