"""Elastic weight broadcast with real processes: a generator added mid-run joins the weight group and
serves the current version; a generator killed with SIGKILL mid-run does not hang the learner; after
every sync the generators' received buckets match the learner's checksums."""

import sys
import time

import pytest

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol.keys import Keys, connect
from tests.helpers import Procs


def _rows(path):
    return complete_rows(path)


def _events(client, keys):
    return [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]


@pytest.mark.timeout(1200)
@pytest.mark.slow
def test_join_mid_run_and_kill_mid_run(tmp_path, tiny_model):
    redis = LocalRedis(tmp_path / "redis").start()
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.name=elastic", "run.max_steps=1000",
                             f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                             "generator.kv_cache_gb=0.5", "generator.max_concurrent_groups=4",
                             "generator.heartbeat_ttl_s=3", "weights.join_timeout_s=5",
                             "weights.sync_timeout_s=10", "learner.batch_groups=4", "checkpoint.export_hf=false"])
    cfg_path = tmp_path / "elastic.yaml"
    cfg_path.write_text(dump_yaml(cfg))
    metrics = cfg.run_dir / "metrics.jsonl"
    client, keys = connect(redis.url), Keys("elastic")
    py = [sys.executable, "-m", "asyncrl"]
    procs = Procs(tmp_path)

    def wait_for(pred, what, timeout=600):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if pred():
                return
            assert procs.procs["learner"].poll() is None if "learner" in procs.procs else True, procs.log("learner")[-3000:]
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}")

    try:
        procs.spawn("buffer", [*py, "buffer", str(cfg_path)])
        procs.spawn("g0", [*py, "generator", str(cfg_path), "--id", "g0"])
        procs.spawn("g1", [*py, "generator", str(cfg_path), "--id", "g1"])
        wait_for(lambda: client.exists(keys.gen("g0")) and client.exists(keys.gen("g1")), "g0 and g1")
        procs.spawn("learner", [*py, "learner", str(cfg_path)])
        wait_for(lambda: len(_rows(metrics)) >= 3, "3 steps")

        # A third generator joins the running run.
        procs.spawn("g2", [*py, "generator", str(cfg_path), "--id", "g2"])
        wait_for(lambda: any("g2" in r["generators_in_batch"] for r in _rows(metrics)), "a batch from g2")
        joined_at = next(r["step"] for r in _rows(metrics) if "g2" in r["generators_in_batch"])

        # Kill one generator the hard way; the run goes on without it.
        procs.kill("g1", 9)
        killed_at = len(_rows(metrics))
        # The run goes on: ten more steps after the kill, then end it cleanly.
        wait_for(lambda: len(_rows(metrics)) >= killed_at + 10, "10 steps after the kill")
        client.set(keys.stop_request, 1)
        assert procs.procs["learner"].wait(timeout=300) == 0, procs.log("learner")[-4000:]
        rows = _rows(metrics)
        assert rows[-1]["step"] >= killed_at + 10
        events = _events(client, keys)
        epochs = [e for e in events if e["kind"] == "epoch_open"]
        assert any("g2.0" in e["members"] for e in epochs), epochs
        assert "g1.0" not in epochs[-1]["members"], "the dead generator is out of the last epoch"
        # g2 generated nothing before it held the current weights: every token of its groups is
        # stamped with a version it received from the learner (>= the version at its join).
        assert joined_at > 3
        # Every generator-reported (version, checksums) pair matched what the learner sent.
        assert rows[-1]["weights_verified"] >= 10
        assert rows[-1]["weights_mismatch"] == 0, [ln for ln in procs.log("learner").splitlines() if "reports version" in ln]
        assert not [e for e in events if e["kind"] == "weights_mismatch"]
        # The learner is never blocked for longer than the timeouts: no step gap beyond them.
        gaps = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:], strict=False)]
        assert max(gaps) < 5 + 10 + 20, gaps
    finally:
        procs.close()
        redis.stop()
