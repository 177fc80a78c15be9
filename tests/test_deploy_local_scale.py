"""`asyncrl scale` against a local `asyncrl run`: a generator added mid-run joins, one removed drains
away without failing the run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol.keys import Keys, connect

pytestmark = pytest.mark.slow


def _rows(run_dir):
    return complete_rows(run_dir / "metrics.jsonl")


def _wait(cond, timeout_s, what, log):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"waited {timeout_s}s for {what}\n{log()}"
        time.sleep(2)


def test_local_scale_up_and_down(tmp_path, tiny_model):
    # The run ends by the test's stop request: no step budget that a fast run could use up first.
    overrides = [f"run.dir={tmp_path / 'runs'}", f"model.path={tiny_model}", "run.name=lscale", "run.max_steps=100000",
                 "learner.nproc=1", "generator.kv_cache_gb=0.5", "generator.cpu_threads=1", "run.stall_timeout_s=0"]
    run_dir = tmp_path / "runs" / "lscale"
    out = open(tmp_path / "run.log", "w")
    launcher = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", "configs/tiny.yaml", *overrides],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def log():
        logs = "\n".join(f"== {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
        return (tmp_path / "run.log").read_text()[-4000:] + logs

    def scale(delta):
        res = subprocess.run([sys.executable, "-m", "asyncrl", "scale", "configs/tiny.yaml", *overrides,
                              "--generators", delta], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr

    try:
        _wait(lambda: len(_rows(run_dir)) >= 2, 900, "two steps", log)
        scale("+1")
        _wait(lambda: any("g1" in r["generators_in_batch"] for r in _rows(run_dir)), 900, "g1 in a batch", log)
        scale("-1")
        _wait(lambda: "generator g1 left" in (run_dir / "logs" / "generator-g1.log").read_text(), 300,
              "g1 to drain", log)
        steps = len(_rows(run_dir))
        _wait(lambda: len(_rows(run_dir)) >= steps + 2, 600, "two steps after the scale-down", log)
        assert launcher.poll() is None, log()  # a scaled-down generator is no failure
        client = connect((run_dir / "redis_url").read_text().strip())
        client.set(Keys("lscale").stop_request, 1)
        assert launcher.wait(timeout=300) == 0, log()
    finally:
        if launcher.poll() is None:
            from asyncrl.launch.launcher import kill_tree

            kill_tree(launcher.pid, 9)
        out.close()
