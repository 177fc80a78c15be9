"""run.mode=sync: the lockstep baseline. The buffer releases exactly one batch per learner version,
generators start groups only with the learner's current weights, and no trained token is stale."""

import json
import subprocess
import sys

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.modes import admission_staleness, may_generate
from buffers.service import BufferService


def test_sync_mode_config_checks_name_the_fix():
    assert load_config(None, []).run.mode == "async"  # async stays the default
    with pytest.raises(ConfigError, match="weights.sync_every=1"):
        load_config(None, ["run.mode=sync", "weights.sync_every=2"])
    with pytest.raises(ConfigError, match="buffer.sampling=fifo"):
        load_config(None, ["run.mode=sync", "buffer.sampling=replay", "buffer.replay_ratio=2"])
    with pytest.raises(ConfigError, match="algorithm.max_staleness >= 2"):
        load_config(None, ["weights.sync_every=3", "algorithm.max_staleness=1"])
    assert load_config(None, ["weights.sync_every=2", "algorithm.max_staleness=1"]).weights.sync_every == 2
    cfg = load_config(None, ["run.mode=sync", "algorithm.max_staleness=3"])
    assert admission_staleness(cfg) == 0
    assert admission_staleness(load_config(None, ["algorithm.max_staleness=3"])) == 3


def test_generators_start_groups_only_with_the_current_version():
    assert may_generate("sync", 3, 3)
    assert not may_generate("sync", 2, 3)  # the learner stepped; these weights are one behind
    assert not may_generate("sync", -1, 0)  # no weights yet
    assert may_generate("async", 2, 3)  # async keeps sampling across updates


def test_buffer_releases_exactly_one_batch_per_version(make_cfg, redis_server):
    """Real buffer over a real redis-server: with run.mode=sync the feed holds exactly
    learner.batch_groups prompts per learner version, whatever algorithm.max_staleness says."""
    cfg = make_cfg("run.mode=sync", "learner.batch_groups=3", "algorithm.max_staleness=4", redis=redis_server)
    svc = BufferService(cfg)
    try:
        svc.setup()
        assert svc.release_prompts() == 3
        assert svc.release_prompts() == 0  # nothing more until the learner steps
        svc.client.set(svc.keys.version, 1)
        assert svc.release_prompts() == 3
        assert svc.client.xlen(svc.keys.prompts) == 6
        asynchronous = BufferService(make_cfg("learner.batch_groups=3", "algorithm.max_staleness=4", "run.name=a",
                                              redis=redis_server))
        asynchronous.setup()
        assert asynchronous.release_prompts() == (0 + 4 + 1) * 3
    finally:
        svc.sock.close(0)


@pytest.mark.slow
def test_sync_run_trains_every_token_with_lag_zero(tmp_path, tiny_model):
    """A real `asyncrl run run.mode=sync`: redis-server, buffer, a vLLM generator, the FSDP2 learner."""
    steps = 4
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "run.mode=sync", f"run.max_steps={steps}",
                        f"run.dir={tmp_path / 'runs'}", f"model.path={tiny_model}", "algorithm.max_staleness=2"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        # Every trained token was sampled by the very version that trained on it.
        assert row["lag_max"] == 0 and list(row["lag_hist"]) == ["0"], row["lag_hist"]
        assert row["lag_hist"]["0"] == row["tokens"] > 0
        assert row["num_groups"] == 8 and row["dropped_stale"] == 0
    assert rows[-1]["version"] == steps
