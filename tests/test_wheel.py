"""A built (non-editable) wheel carries its configs and Slurm templates as package data, and finds a
config by name from any directory."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# What the copy of the source tree leaves out: the venv, VCS data, build and run outputs.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "runs", "models",
                                    ".pytest_cache", ".ruff_cache", ".hypothesis", "wandb", ".gpu", ".whl")


def test_built_wheel_installed_elsewhere_prints_the_default_config(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE, symlinks=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("asyncrl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every config of the checkout ships, as a plain file (asyncrl/configs links to configs/ there).
    assert {f"asyncrl/configs/{c.name}" for c in (REPO / "configs").glob("*.yaml")} <= names
    assert {f"asyncrl/templates/slurm/{n}.sbatch" for n in ("core", "learner", "generator")} <= names

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # The checkout is importable from this venv (an editable install): the installed copy must win.
    env = {**os.environ, "PYTHONPATH": str(site)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = ("import asyncrl, asyncrl.config as c, asyncrl.launch.deploy_slurm as d; "
             "print(asyncrl.__file__); print(c.DEFAULT_CONFIG); print(d.TEMPLATES)")
    r = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    module, default, templates = (Path(line) for line in r.stdout.splitlines())
    assert module.is_relative_to(site) and default.is_relative_to(site) and templates.is_relative_to(site)
    assert default.is_file() and (templates / "learner.sbatch").is_file()

    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "--print-config"], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "name: tiny" in r.stdout and "task: copy" in r.stdout and "max_steps: 30" in r.stdout

    # A shipped config by name, from a directory that holds no configs/.
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "smollm2_arith_cpu", "--print-config"], cwd=elsewhere,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "name: smollm2_arith_cpu" in r.stdout and "task: arith" in r.stdout
    r = subprocess.run([sys.executable, "-m", "asyncrl", "configs"], cwd=elsewhere, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "smollm2_arith " in r.stdout and str(site) in r.stderr, r.stdout + r.stderr
