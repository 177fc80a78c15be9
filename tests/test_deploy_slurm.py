"""`asyncrl submit slurm` and `asyncrl scale` on a real one-node Slurm cluster (tests/slurm_cluster.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol.keys import Keys, connect
from tests import slurm_cluster

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 900


@pytest.fixture
def slurm(tmp_path_factory):
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


def _asyncrl(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, timeout=timeout)


def _overrides(tmp_path, tiny_model, name, *extra):
    return [f"run.dir={tmp_path / 'runs'}", f"model.path={tiny_model}", f"run.name={name}", "learner.nproc=1",
            "generator.kv_cache_gb=0.5", "generator.cpu_threads=1", "run.stall_timeout_s=0", *extra]


def _submit(slurm, tmp_path, tiny_model, name, num_generators, *extra):
    res = _asyncrl("submit", "slurm", "configs/tiny.yaml", *_overrides(tmp_path, tiny_model, name, *extra),
                   "--generators", str(num_generators))
    assert res.returncode == 0, res.stderr + slurm.logs()
    jobs = dict(line.split("\t") for line in res.stdout.strip().splitlines())
    assert set(jobs) == {"core", "learner", *[f"g{i}" for i in range(num_generators)]}
    return jobs


def _rows(run_dir):
    return complete_rows(run_dir / "metrics.jsonl")


def _wait(cond, timeout_s, what, diag):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := cond()):
            return value
        time.sleep(2)
    raise AssertionError(f"waited {timeout_s}s for {what}\n{diag()}")


def _ended(slurm, job, timeout_s, what, diag):
    """The job's final state, once it has one (slurmctld's own timeouts under load are waited out)."""
    state = slurm.state_when_ended(job, timeout_s)
    if state is None:
        raise AssertionError(f"waited {timeout_s}s for {what}\n{diag()}")
    return state


def _nothing_left(jobs, timeout_s, diag):
    """No process of these jobs is left (Slurm's KillWait is 60 s in tests/slurm_cluster.py)."""
    left = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = {job: procs for job in jobs if (procs := slurm_cluster.job_processes(job))}
        if not left:
            return
        time.sleep(2)
    raise AssertionError(f"processes left {timeout_s}s after their jobs ended: {left}\n{diag()}")


# vLLM's per-sync chatter: dropped from the focused log so that its last lines are the ones that tell.
NOISE = ("Attempted to load weight", "RotaryEmbedding", "pause state", "prefix cache", "Reloading")


def _diag(slurm, run_dir, focus=None):
    """All logs' tails, squeue, Slurm's logs; then, last (what a truncated report still shows), the
    tail of the `focus` generator's log without vLLM's per-sync lines."""
    def show():
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        out = logs + subprocess.run(["squeue"], capture_output=True, text=True).stdout + slurm.logs()[-3000:]
        for p in sorted((run_dir / "logs").glob(f"generator-{focus}-*.log")) if focus else []:
            lines = [line for line in p.read_text().splitlines() if not any(n in line for n in NOISE)]
            out += f"\n== {p.name}, without vLLM's per-sync lines\n" + "\n".join(lines)[-5000:]
        return out
    return show


def test_submit_slurm_runs_tiny_config_to_completion(slurm, tmp_path, tiny_model):
    jobs = _submit(slurm, tmp_path, tiny_model, "slurm1", 1, "run.max_steps=3")
    run_dir = tmp_path / "runs" / "slurm1"
    diag = _diag(slurm, run_dir)
    assert _ended(slurm, jobs["learner"], RUN_TIMEOUT_S, "the learner job to finish", diag) == "COMPLETED", diag()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows][-1] == 3, diag()
    assert all(r["generators_in_batch"] == ["g0"] for r in rows)
    # The learner set the stop key: the generator and the core job leave by themselves, cleanly.
    for role in ("g0", "core"):
        assert _ended(slurm, jobs[role], 180, f"the {role} job to end", diag) == "COMPLETED", diag()
    _nothing_left(jobs.values(), 30, diag)
    assert not (run_dir / "redis_url").exists()  # the core job took its address down with Redis
    for name in ("core", "learner", "buffer", "generator-g0"):
        assert any((run_dir / "logs").glob(f"{name}*.log")), f"no {name} log"


@pytest.mark.timeout(1200)
def test_slurm_scale_up_down_and_scancel(slurm, tmp_path, tiny_model):
    name = "slurm2"
    overrides = _overrides(tmp_path, tiny_model, name, "run.max_steps=400")
    jobs = _submit(slurm, tmp_path, tiny_model, name, 2, "run.max_steps=400")
    run_dir = tmp_path / "runs" / name
    diag = _diag(slurm, run_dir)
    _wait(lambda: len(_rows(run_dir)) >= 2, RUN_TIMEOUT_S, "two learner steps", diag)
    client = connect((run_dir / "redis_url").read_text().strip())
    keys = Keys(name)
    assert client.hget(keys.deploy, "backend") == b"slurm"

    # +1: a third generator job joins the running run; its groups reach the learner.
    res = _asyncrl("scale", "configs/tiny.yaml", *overrides, "--generators", "+1")
    assert res.returncode == 0 and "g2" in res.stdout, res.stderr
    _wait(lambda: any("g2" in r["generators_in_batch"] for r in _rows(run_dir)), RUN_TIMEOUT_S,
          "a batch with g2's trajectories", diag)

    # -1: the newest generator (g2) drains away: SIGTERM, pushes what it has, exits 0.
    res = _asyncrl("scale", "configs/tiny.yaml", *overrides, "--generators", "-1")
    assert res.returncode == 0 and "g2" in res.stdout, res.stderr
    g2_job = next(job for job, gid, _ in _generator_jobs_all(run_dir) if gid == "g2")
    state = _ended(slurm, g2_job, 300, "g2 to drain and leave", diag)
    assert state == "COMPLETED", _diag(slurm, run_dir, focus="g2")()
    leaves = [f for _, f in client.xrange(keys.events) if f[b"kind"] == b"generator_leave"]
    assert any(f[b"id"] == b"g2" for f in leaves)

    # scancel of g1 (the whole job: SIGTERM to each of its processes, SIGKILL after KillWait): the run
    # goes on with g0, and nothing of g1 is left, its engine's processes included.
    assert len(slurm_cluster.job_processes(jobs["g1"])) >= 3, slurm_cluster.job_processes(jobs["g1"])
    subprocess.run(["scancel", jobs["g1"]], check=True)
    _ended(slurm, jobs["g1"], 300, "g1 to be cancelled", diag)
    _nothing_left([jobs["g1"]], 90, diag)
    steps_then = len(_rows(run_dir))
    _wait(lambda: len(_rows(run_dir)) >= steps_then + 2, RUN_TIMEOUT_S, "two more steps after scancel", diag)
    assert slurm.job_state(jobs["learner"]) == "RUNNING" and slurm.job_state(jobs["core"]) == "RUNNING", diag()
    assert _rows(run_dir)[-1]["generators_in_batch"] == ["g0"]

    # scancel of the rest of the run, as a user stops it: every process of every job is gone.
    subprocess.run(["scancel", jobs["learner"], jobs["core"], jobs["g0"]], check=True)
    for role in ("learner", "core", "g0"):
        _ended(slurm, jobs[role], 300, f"the {role} job to be cancelled", diag)
    _nothing_left([*jobs.values(), g2_job], 90, diag)


def _generator_jobs_all(run_dir):
    """(job, generator id, state) from the logs' names: generator-{gid}-{job}.log."""
    out = []
    for p in (run_dir / "logs").glob("generator-*.log"):
        _, gid, job = p.stem.split("-")
        out.append((job, gid, ""))
    return out
