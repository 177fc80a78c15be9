"""`asyncrl status` on a run whose redis-server is gone reads the state its run folder saved (the AOF),
also when another redis-server has taken the run's port since; a run folder without one fails as
before, naming the URL."""

import json
import subprocess
import sys

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol.keys import Keys, connect


def _run_folder(tmp_path):
    """A launcher's layout: {run_dir}/redis with the AOF and {run_dir}/config.yaml naming its URL."""
    run_dir = tmp_path / "runs" / "ended"
    server = LocalRedis(run_dir / "redis", appendfsync="always").start()
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.name=ended", f"buffer.redis_url={server.url}"])
    (run_dir / "config.yaml").write_text(dump_yaml(cfg))
    client, keys = connect(server.url), Keys("ended")
    client.hset(keys.learner, mapping={"step": 7, "updated_at": 1.0})
    client.set(keys.version, 7)
    client.set(keys.stop, 1)
    client.xadd(keys.events, {"kind": "learner_done", "version": 7})
    return run_dir, server


def _status(cwd, *argv):
    return subprocess.run([sys.executable, "-m", "asyncrl", "status", "runs/ended/config.yaml", *argv], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_status_reads_the_saved_state_of_an_ended_run_even_if_its_port_is_taken(tmp_path):
    run_dir, server = _run_folder(tmp_path)
    try:  # while its server is up, the run is read live
        r = _status(tmp_path, "--once", "--json")
        assert r.returncode == 0 and not json.loads(r.stdout)["ended"] and "has ended" not in r.stderr, r.stderr
    finally:
        server.stop()
    port = server.port
    files = {p: p.read_bytes() for p in (run_dir / "redis").rglob("*") if p.is_file()}
    r = _status(tmp_path, "--once", "--json")
    assert r.returncode == 0, r.stderr
    assert "run 'ended' has ended" in r.stderr
    snap = json.loads(r.stdout)
    assert snap["ended"] and snap["stopped"] and snap["learner"]["step"] == 7 and snap["learner"]["version"] == 7
    # Another redis-server on the run's old port holds nothing of this run: it is not read.
    other = LocalRedis(tmp_path / "other", port=port).start()
    try:
        r = _status(tmp_path, "--once", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["learner"]["step"] == 7, r.stderr
        # ... unless the user names it.
        r = _status(tmp_path, "--once", "--json", "--redis", other.url)
        assert r.returncode == 0 and not json.loads(r.stdout)["ended"], r.stderr
        assert json.loads(r.stdout)["learner"]["step"] == 0
    finally:
        other.stop()
    # The run folder was only read (the logs of the copies' servers are elsewhere).
    assert {p: p.read_bytes() for p in (run_dir / "redis").rglob("*") if p.is_file()} == files


def test_status_without_saved_state_names_the_unreachable_redis(tmp_path):
    run_dir, server = _run_folder(tmp_path)
    server.stop()
    port = server.port
    import shutil

    shutil.rmtree(run_dir / "redis")
    r = _status(tmp_path, "--once")
    assert r.returncode == 2
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in r.stderr and "holds no saved state" in r.stderr
