"""End-to-end runs with every real part: redis-server, buffer, vLLM generators (CPU build), a
torchrun FSDP2 learner group over gloo, and the weight broadcast group."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.config import dump_yaml
from asyncrl.launch.redis_server import LocalRedis


def _metrics(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_default_run_learns_within_the_staleness_bound(tmp_path):
    # The embedded default as a user runs it, from a fresh folder: relative run dir, the tiny model
    # written by the run itself; only the length is shortened.
    run_dir = tmp_path / "runs" / "tiny"
    steps = 24
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={steps}"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert sum(1 for line in r.stdout.splitlines() if line.startswith("step=")) == steps
    first = sum(row["reward_mean"] for row in rows[:4]) / 4
    last = sum(row["reward_mean"] for row in rows[-6:]) / 6
    assert last > first + 0.08, f"reward did not rise: first={first:.3f} last={last:.3f}"
    # Every trained token's version lag is within algorithm.max_staleness (1 in tiny.yaml).
    assert max(row["lag_max"] for row in rows) <= 1
    assert all(int(k) <= 1 for row in rows for k in row["lag_hist"])
    assert rows[-1]["version"] == steps
    # No generation wasted: the admission rule releases a prompt only once the weights it will start
    # on are within the staleness bound of the step that trains it.
    assert rows[-1]["dropped_frac"] < 0.02, [row["dropped_stale"] for row in rows]
    assert "dropped_frac=" in next(line for line in r.stdout.splitlines() if line.startswith("step="))
    # The step row says where the learner's time went (its pushes overlapping the next step: below).
    assert all(row["compute_s"] > 0 and row["data_wait_s"] >= 0 and row["push_wait_s"] >= 0 for row in rows)
    startup = next(line for line in r.stdout.splitlines() if line.startswith("startup: "))
    for milestone in ("launch +0.0s", "g0 engine", "learner ready", "first batch", "first step", "first push"):
        assert milestone in startup, startup
    # run.affinity=auto (the default) on a machine of 2-4 CPUs pins the roles apart, and says so.
    allowed = len(os.sched_getaffinity(0))
    pinned = next(line for line in r.stdout.splitlines() if line.startswith("affinity: "))
    if 2 <= allowed <= 4:
        assert f"(auto on {allowed} CPUs; run.affinity=off to disable)" in pinned, pinned
        import yaml

        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert all(cfg[role]["cpus"] for role in ("generator", "learner", "buffer")), "in the config the roles read"


def _overlapping(rows: list[dict]) -> list[int]:
    """The versions whose push was still going (the generator receiving and loading it) when the
    learner's next step started."""
    by_step = {row["step"]: row for row in rows}
    return [row["push_version"] for row in rows if "push_version" in row and row["push_version"] + 1 in by_step
            and by_step[row["push_version"] + 1]["step_started_at"] < row["push_done_at"]]


@pytest.mark.slow
def test_the_next_step_starts_while_the_generator_still_loads_the_last_version(tmp_path, tiny_model):
    """weights.overlap (the default): the learner never waits for a push. The generator holds back
    0.2 s before it takes part in each push (a fault injected for this test), so a push lasts about ten
    times the learner's time between two steps; eight passes over each batch make a step (about 0.6 s)
    outlast the generator's next batch. A learner that waited for its pushes would start no step before
    the last push was done (as with weights.overlap=false, below)."""
    env = {**os.environ, "ASYNCRL_FAULT_PUSH_DELAY_S": "0.2"}
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "run.max_steps=8", "learner.ppo_epochs=8",
                        f"model.path={tiny_model}"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = _metrics(tmp_path / "runs" / "tiny")
    assert [row["step"] for row in rows] == list(range(1, 9))
    assert all(row["push_s"] >= 0.2 for row in rows if "push_s" in row)  # the injected hold-back took effect
    overlapping = _overlapping(rows)
    assert len(overlapping) >= 5, [(row.get("push_version"), row.get("push_done_at"), row["step_started_at"])
                                   for row in rows]
    assert max(row["lag_max"] for row in rows) <= 1  # and every trained token within the staleness bound
    # Only the run's last push is waited for (the run ends with it); none before it.
    assert sum(row["push_wait_s"] for row in rows[:-1]) < 0.05, [row["push_wait_s"] for row in rows]


@pytest.mark.slow
def test_separate_processes_two_generators_two_learner_ranks(tmp_path, tiny_model):
    """The same run launched as separate commands, as a user would in separate shells."""
    from asyncrl.config import load_config

    redis = LocalRedis(tmp_path / "redis").start()
    run_dir = tmp_path / "runs" / "split"
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.name=split", "run.max_steps=6",
                             f"model.path={tiny_model}", f"buffer.redis_url={redis.url}", "learner.nproc=2",
                             "generator.kv_cache_gb=0.5", "generator.max_concurrent_groups=4",
                             "weights.overlap=false"])
    cfg_path = tmp_path / "split.yaml"
    cfg_path.write_text(dump_yaml(cfg))
    py = [sys.executable, "-m", "asyncrl"]
    logs = {}
    procs = {}

    def spawn(name, argv):
        logs[name] = open(tmp_path / f"{name}.log", "w")
        procs[name] = subprocess.Popen(argv, stdout=logs[name], stderr=subprocess.STDOUT, start_new_session=True)

    try:
        spawn("buffer", [*py, "buffer", str(cfg_path)])
        spawn("g0", [*py, "generator", str(cfg_path), "--id", "g0"])
        spawn("g1", [*py, "generator", str(cfg_path), "--id", "g1"])
        # Both generators up first, each leasing at most 4 groups at a time: both must contribute.
        from asyncrl.protocol.keys import Keys, connect

        client, keys = connect(redis.url), Keys("split")
        deadline = time.time() + 600
        while not (client.exists(keys.gen("g0")) and client.exists(keys.gen("g1"))) and time.time() < deadline:
            assert procs["g0"].poll() is None and procs["g1"].poll() is None
            time.sleep(0.5)
        spawn("learner", [*py, "learner", str(cfg_path)])
        assert procs["learner"].wait(timeout=900) == 0, (tmp_path / "learner.log").read_text()[-4000:]
        # The learner set the stop key: buffer and generators leave on their own, cleanly.
        for name in ("buffer", "g0", "g1"):
            assert procs[name].wait(timeout=120) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        rows = _metrics(run_dir)
        assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
        text = (tmp_path / "learner.log").read_text()
        assert "members=['g0.0', 'g1.0']" in text, "both generators must be in the weight group"
        gens = {g for row in rows for g in row.get("generators_in_batch", [])}
        assert gens == {"g0", "g1"}, gens
        # weights.overlap=false: each push was waited for, so no step began before the last one was done.
        pushes = [row["push_version"] for row in rows if "push_version" in row]
        assert pushes and not _overlapping(rows)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in logs.values():
            f.close()
        redis.stop()
