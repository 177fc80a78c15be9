"""`asyncrl submit ray` on a real local Ray head (`ray start --head`, `ray stop` after)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.launch.redis_server import free_port
from asyncrl.observe.metrics import complete_rows

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
RAY = shutil.which("ray") or str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One real local Ray head with 2 CPUs for this file's runs (each has a run name of its own and
    leaves no actor behind, which the teardown tests check)."""
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
    return complete_rows(run_dir / "metrics.jsonl")


def test_submit_ray_runs_to_completion_and_survives_a_killed_generator(ray_head, tmp_path, tiny_model):
    dashboard, gcs = ray_head
    name = "ray1"
    run_dir = tmp_path / "runs" / name
    # Submitted from a directory outside the checkout with a relative run.dir: every role runs where the
    # run was submitted from, so the run folder is there.
    argv = [sys.executable, "-m", "asyncrl", "submit", "ray", str(REPO / "configs" / "tiny.yaml"), "run.dir=runs",
            f"model.path={tiny_model}", f"run.name={name}", "run.max_steps=24", "learner.nproc=1",
            "generator.kv_cache_gb=0.5", "generator.cpu_threads=1", "run.stall_timeout_s=0",
            "--address", dashboard, "--generators", "1", "--cpus-per-role", "0.25"]
    log = open(tmp_path / "submit.log", "w")
    submit = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
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
    assert "-m asyncrl.launch.deploy_ray driver" in out  # the installed package's driver, not a checkout's file
    # The restarted actor spawned a second generator process with the same id.
    assert out.count("[gen-g0] started") >= 2, out[-5000:]


def _processes_of(marker: str, but: set[int], redis_port: int | None = None) -> list[str]:
    """Processes whose command line or environment names `marker` (the run's directory), and the
    run's redis-server (it rewrites its command line to `redis-server HOST:PORT`)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) in but:
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if marker in cmd or marker.encode() in env or (
                redis_port is not None and "redis-server" in cmd and f":{redis_port}" in cmd):
            found.append(f"{d.name}: {cmd[:300]}")
    return found


def _submit_argv(tmp_path, tiny_model, name: str, dashboard: str, max_steps: int) -> list[str]:
    """`asyncrl submit ray` of the tiny config with one HF-backend generator, as the teardown tests run it."""
    return [sys.executable, "-m", "asyncrl", "submit", "ray", "configs/tiny.yaml", f"run.dir={tmp_path / 'runs'}",
            f"model.path={tiny_model}", f"run.name={name}", f"run.max_steps={max_steps}", "learner.nproc=1",
            "generator.backend=hf", "generator.max_tokens=16", "run.stall_timeout_s=0",
            "--address", dashboard, "--generators", "1", "--cpus-per-role", "0.25"]


def test_ray_job_stop_leaves_no_process_of_the_run_behind(ray_head, tmp_path, tiny_model):
    """`ray job stop` mid-run: the core's redis-server and buffer, the learner (torchrun and its
    rank) and the generator are all gone, not only the Ray actors that started them."""
    import os
    import re

    dashboard, _ = ray_head
    name = "raystop"
    run_dir = (tmp_path / "runs" / name).resolve()
    argv = _submit_argv(tmp_path, tiny_model, name, dashboard, 100000)
    log_path = tmp_path / "submit.log"
    log = open(log_path, "w")
    submit = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) < 1:
            assert time.monotonic() < deadline and submit.poll() is None, log_path.read_text()[-5000:]
            time.sleep(2)
        port = int((run_dir / "redis_url").read_text().strip().rsplit(":", 1)[1].split("/")[0])
        running = _processes_of(str(run_dir), {os.getpid(), submit.pid}, port)
        assert any("redis-server" in p for p in running) and any("generator" in p for p in running), running
        job = re.search(r"--submission-id (\S+)", log_path.read_text()).group(1)
        res = subprocess.run([RAY, "job", "stop", "--address", dashboard, job], capture_output=True, text=True,
                             timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        submit.wait(timeout=60)
        deadline = time.monotonic() + 60  # the roles' own leave bounds (generator: drain timeout + 15 s)
        while (left := _processes_of(str(run_dir), {os.getpid()}, port)) and time.monotonic() < deadline:
            time.sleep(1)
        assert not left, "left behind by `ray job stop`:\n" + "\n".join(left)
    finally:
        if submit.poll() is None:
            submit.kill()
        log.close()
        from asyncrl.launch.launcher import kill_tree

        for p in _processes_of(str(run_dir), {os.getpid()}):
            kill_tree(int(p.split(":")[0]), 9)


def test_ray_orderly_teardown_logs_no_error_and_leaves_nothing(ray_head, tmp_path, tiny_model):
    """A run that finishes (max_steps): Redis outlives every role's last call (the driver stops the
    core last), so no role logs an ERROR on the way out, and no process of the run is left."""
    import os

    dashboard, _ = ray_head
    name = "rayend"
    run_dir = (tmp_path / "runs" / name).resolve()
    argv = _submit_argv(tmp_path, tiny_model, name, dashboard, 3)
    log_path = tmp_path / "submit.log"
    with open(log_path, "w") as log:
        res = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=900)
    out = log_path.read_text()
    assert res.returncode == 0 and "learner exited with 0" in out, out[-5000:]
    assert _rows(run_dir)[-1]["step"] == 3
    logs = {"submit": out, **{p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}}
    errors = [f"{n}: {line}" for n, text in logs.items() for line in text.splitlines() if " ERROR " in line]
    assert not errors, "\n".join(errors[:20])
    assert not _processes_of(str(run_dir), {os.getpid()}), "left behind by an orderly teardown"


def test_submit_ray_asking_more_cpus_than_the_cluster_has_fails_fast_with_one_line(ray_head, tmp_path):
    """A job the cluster cannot hold stops at once with one line saying what it needs and what the
    cluster has, instead of waiting for its last placement group forever."""
    dashboard, _ = ray_head
    argv = [sys.executable, "-m", "asyncrl", "submit", "ray", "configs/tiny.yaml", f"run.dir={tmp_path / 'runs'}",
            "run.name=toobig", "--address", dashboard, "--generators", "1", "--cpus-per-role", "1"]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    lines = {x for x in out.splitlines() if "the run needs" in x}  # `ray job submit` repeats the job's log
    assert len(lines) == 1 and "the run needs CPU=3; the cluster has CPU=2" in lines.pop(), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "runs" / "toobig" / "redis_url").exists(), "no role was started"
