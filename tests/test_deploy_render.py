"""The Slurm scripts `asyncrl submit slurm --dry-run` renders, and scale-argument checks (no cluster)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.launch.elastic import parse_delta


def _dry_run(tmp_path, *args, overrides=()):
    res = subprocess.run([sys.executable, "-m", "asyncrl", "submit", "slurm", "configs/tiny.yaml",
                          f"run.dir={tmp_path}", "run.name=r1", "learner.nproc=4", "learner.batch_groups=8",
                          'deploy.slurm_extra=["--account=rl"]', *overrides, "--dry-run", *args],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_dry_run_multi_node_scripts(tmp_path):
    out = _dry_run(tmp_path, "--learner-nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                   overrides=["deploy.bind_host=0.0.0.0"])
    core, learner, generator = out.split("# ---- ")[1:4]
    assert "--job-name=asyncrl-r1-core" in core and "asyncrl.launch.deploy_core core" in core
    assert "#SBATCH --nodes=2" in learner and "#SBATCH --gpus-per-node=8" in learner
    assert "--nnodes 2" in learner and "--nproc-per-node 4" in learner and "scontrol show hostnames" in learner
    assert "srun" in learner and "--rdzv-backend c10d" in learner
    assert '"deploy.bind_host=$(hostname)"' in learner  # each node publishes its own name
    for script in (core, learner, generator):
        assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=rl" in script
        assert "@@" not in script
    assert 'kill -TERM "$PID"' in generator  # SIGTERM reaches the generator only: it drains
    assert not (tmp_path / "r1" / "slurm").exists()  # a dry run writes nothing


def test_dry_run_single_node_cpu(tmp_path):
    learner = _dry_run(tmp_path).split("# ---- ")[2]
    assert "HEAD=127.0.0.1" in learner and "#SBATCH --gpus-per-node" not in learner and '"deploy.bind_host=$(hostname)"' not in learner


@pytest.mark.parametrize("text,delta", [("+1", 1), ("-2", -2), ("+10", 10)])
def test_parse_delta(text, delta):
    assert parse_delta(text) == delta


@pytest.mark.parametrize("text", ["1", "0", "+0", "x", ""])
def test_parse_delta_rejects(text):
    with pytest.raises(ValueError):
        parse_delta(text)


def test_scripts_start_where_submit_ran_not_in_the_package(tmp_path):
    """A config found by name from another directory: every job starts there (where the config's
    relative paths point), never in the folder asyncrl is installed in."""
    import asyncrl

    work = tmp_path / "work"
    work.mkdir()
    res = subprocess.run([sys.executable, "-m", "asyncrl", "submit", "slurm", "tiny", "run.name=r1", "--dry-run"],
                         cwd=work, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    scripts = res.stdout.split("# ---- ")[1:4]
    package_root = str(Path(asyncrl.__file__).resolve().parents[1])
    for script in scripts:
        assert f"\ncd {work}\n" in script and f"cd {package_root}\n" not in script, script
        assert f"{work}/runs/r1/config.yaml" in script
