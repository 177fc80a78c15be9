"""`asyncrl submit ray` on a real local Ray head (`ray start --head`, `ray stop` after)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.redis_server import free_port

pytestmark = pytest.mark.slow

RAY = shutil.which("ray") or str(Path(sys.executable).parent / "ray")


@pytest.fixture
def ray_head(tmp_path_factory):
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'asyncrl[ray]')")
    port, dash = free_port(), free_port()
    tmp = tmp_path_factory.mktemp("ray")
    res = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--node-ip-address=127.0.0.1", "--include-dashboard=true",
                          f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", "--disable-usage-stats",
                          f"--temp-dir={tmp}"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    yield f"http://127.0.0.1:{dash}", f"127.0.0.1:{port}"
    subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


def _rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def test_submit_ray_runs_to_completion_and_survives_a_killed_generator(ray_head, tmp_path, tiny_model):
    dashboard, gcs = ray_head
    name = "ray1"
    run_dir = tmp_path / "runs" / name
    argv = [sys.executable, "-m", "asyncrl", "submit", "ray", "configs/tiny.yaml", f"run.dir={tmp_path / 'runs'}",
            f"model.path={tiny_model}", f"run.name={name}", "run.max_steps=24", "learner.nproc=1",
            "generator.kv_cache_gb=0.5", "generator.cpu_threads=1", "run.stall_timeout_s=0",
            "--address", dashboard, "--generators", "1", "--cpus-per-role", "0.25"]
    log = open(tmp_path / "submit.log", "w")
    submit = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while len(_rows(run_dir)) < 2:
            assert time.monotonic() < deadline and submit.poll() is None, (tmp_path / "submit.log").read_text()[-5000:]
            time.sleep(2)
        # Kill the generator's actor mid-run (as a node failure would): Ray restarts it, the run goes on.
        import ray

        ray.init(address=gcs, namespace="asyncrl", log_to_driver=False)
        try:
            actor = ray.get_actor(f"asyncrl-{name}-gen-g0", namespace="asyncrl")
            old_pid = ray.get(actor.pid.remote())
            ray.kill(actor, no_restart=False)
            deadline = time.monotonic() + 300
            while True:
                try:
                    new_pid = ray.get(actor.pid.remote(), timeout=30)
                    if new_pid != old_pid:
                        break
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass
                assert time.monotonic() < deadline, "the generator actor was not restarted"
                time.sleep(2)
        finally:
            ray.shutdown()
        assert submit.wait(timeout=900) == 0, (tmp_path / "submit.log").read_text()[-5000:]
    finally:
        if submit.poll() is None:
            submit.kill()
        log.close()
    rows = _rows(run_dir)
    # 24 steps: long enough that the run cannot finish on what the killed generator left behind.
    assert rows[-1]["step"] == 24
    # The restarted generator (a fresh id, g0r...) joined the run: its groups reached the learner.
    assert any(g.startswith("g0r") for r in rows for g in r["generators_in_batch"]), rows
    out = (tmp_path / "submit.log").read_text()
    assert "[gen-g0] started" in out and "learner exited with 0" in out  # the driver's log, streamed back
    # The restarted actor spawned a second generator process with the same id.
    assert out.count("[gen-g0] started") >= 2, out[-5000:]
