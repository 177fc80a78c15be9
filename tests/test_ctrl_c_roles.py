"""Ctrl-C of roles started by hand, as a terminal sends it (SIGINT to the foreground process group):
each role is gone within 5 s, with no traceback; the learner says so in one line. The learner goes
first, as a person stopping a run does: the generator then leaves without waiting for a learner that
is gone to re-form its weight group."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.launch.launcher import kill_tree
from asyncrl.observe.metrics import complete_rows

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def _start(tmp_path, name, *argv):
    out = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "asyncrl", *argv], stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _ctrl_c(proc, log) -> tuple[float, str]:
    """SIGINT to the role's process group; (seconds until it exited, what it wrote from then on)."""
    before = log.stat().st_size
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    seconds = time.monotonic() - t0
    return seconds, log.read_bytes()[before:].decode(errors="replace")


@pytest.mark.slow
def test_ctrl_c_of_each_hand_started_role_is_quiet_and_quick(tmp_path, redis_server, tiny_model):
    args = [f"buffer.redis_url={redis_server.url}", f"model.path={tiny_model}", f"run.dir={tmp_path / 'runs'}",
            "run.max_steps=1000", "run.stall_timeout_s=0", "logging.prometheus=false"]
    roles = {"buffer": _start(tmp_path, "buffer", "buffer", TINY, *args),
             "generator": _start(tmp_path, "generator", "generator", TINY, "--id", "g0", *args),
             "learner": _start(tmp_path, "learner", "learner", TINY, *args)}
    try:
        deadline = time.time() + 600
        while len(complete_rows(tmp_path / "runs" / "tiny" / "metrics.jsonl")) < 3 and time.time() < deadline:
            for name, p in roles.items():
                assert p.poll() is None, (name, (tmp_path / f"{name}.log").read_text()[-3000:])
            time.sleep(0.2)
        for name in ("learner", "generator", "buffer"):
            seconds, said = _ctrl_c(roles[name], tmp_path / f"{name}.log")
            assert roles[name].poll() is not None and seconds < 5.0, (name, seconds, said[-3000:])
            print(f"{name}: gone {seconds:.1f}s after Ctrl-C")
            assert "Traceback" not in said and "KeyboardInterrupt" not in said, (name, said[-3000:])
            assert "not done in time" not in said, (name, said[-3000:])  # the learner closed its group
            if name == "learner":
                lines = [line for line in said.splitlines() if line.strip()]
                assert len(lines) == 1 and lines[0].startswith("learner: interrupted (SIGINT)"), said[-3000:]
    finally:
        for p in roles.values():
            kill_tree(p.pid, signal.SIGKILL)
