"""`asyncrl run` stopped with Ctrl-C after a checkpoint, then `asyncrl run run.resume=true`: the run goes
on from the checkpoint to run.max_steps, and metrics.jsonl holds each step once (the steps trained
again replace the interrupted run's rows, which are kept in metrics.rolled_back.jsonl)."""

import signal
import subprocess
import sys
import time

import pytest

from asyncrl.launch.launcher import kill_tree
from asyncrl.observe.metrics import complete_rows

STEPS, EVERY = 12, 4


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_ctrl_c_then_resume_goes_on_from_the_checkpoint_with_one_row_per_step(tmp_path, tiny_model):
    argv = [sys.executable, "-m", "asyncrl", "run", f"run.max_steps={STEPS}", f"checkpoint.every={EVERY}",
            f"model.path={tiny_model}", "run.stall_timeout_s=120", "run.on_stall=fail", "logging.prometheus=false"]
    metrics = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    first = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 600
        while len(complete_rows(metrics)) < EVERY + 1 and time.time() < deadline:
            assert first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)
        out, _ = first.communicate(timeout=60)
        assert first.returncode == 130, out[-3000:]
    finally:
        kill_tree(first.pid, signal.SIGKILL)
    stopped_at = max(r["step"] for r in complete_rows(metrics))
    assert EVERY < stopped_at < STEPS, stopped_at
    saved = max(int(p.name.split("-")[1]) for p in (tmp_path / "runs" / "tiny" / "checkpoints").glob("step-*"))

    second = subprocess.run([*argv, "run.resume=true"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"step-{saved:06d}" in second.stdout + second.stderr
    rows = complete_rows(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
    assert [r["version"] for r in rows] == list(range(1, STEPS + 1))
    aside = complete_rows(metrics.with_name("metrics.rolled_back.jsonl"))
    assert [r["step"] for r in aside] == list(range(saved + 1, stopped_at + 1))
