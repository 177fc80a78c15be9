"""A Ray job the cluster cannot hold stops at once with one line saying what it needs and what the
cluster has, instead of waiting for its last placement group forever."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncrl.launch.deploy_ray import shortfall
from tests.test_deploy_ray import ray_head  # noqa: F401 - the fixture: a real local Ray head with 2 CPUs


def test_shortfall_names_what_the_run_needs_and_what_the_cluster_has():
    assert shortfall({"CPU": 2.0, "GPU": 0.0}, {"CPU": 2.0}) is None
    assert shortfall({"CPU": 3.0, "GPU": 0.0}, {"CPU": 2.0}) == "the run needs CPU=3; the cluster has CPU=2 GPU=0"
    assert shortfall({"CPU": 1.0, "GPU": 4.0}, {"CPU": 8.0, "GPU": 2.0}) == \
        "the run needs CPU=1 GPU=4; the cluster has CPU=8 GPU=2"


@pytest.mark.slow
def test_submit_ray_asking_more_cpus_than_the_cluster_has_fails_fast_with_one_line(ray_head, tmp_path):  # noqa: F811
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
