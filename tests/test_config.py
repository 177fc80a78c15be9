import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import REPO_CONFIGS, ConfigError, load_config


def test_misspelled_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner\.lrr'; did you mean 'learner\.lr'"):
        load_config(None, ["learner.lrr=1e-6"])


def test_misspelled_section_and_bad_values_fail_with_the_dotted_path():
    with pytest.raises(ConfigError, match="did you mean 'generator'"):
        load_config(None, ["generatr.n=4"])
    with pytest.raises(ConfigError, match="generator.n: expected an integer"):
        load_config(None, ["generator.n=four"])
    with pytest.raises(ConfigError, match="weights.mode: 'sometimes' is not one of"):
        load_config(None, ["weights.mode=sometimes"])
    with pytest.raises(ConfigError, match="generator.n must be > 1"):
        load_config(None, ["generator.n=1"])
    with pytest.raises(ConfigError, match="learner.batch_groups .* divisible by learner.nproc"):
        load_config(None, ["learner.nproc=3", "learner.batch_groups=8"])


def test_overrides_are_typed():
    cfg = load_config(None, ["learner.lr=1e-6", "run.max_steps=3", "generator.enforce_eager=false"])
    assert cfg.learner.lr == 1e-6 and cfg.run.max_steps == 3 and cfg.generator.enforce_eager is False


@pytest.mark.parametrize("path", sorted(REPO_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    load_config(path)


def test_cli_rejects_misspelled_key_at_start_and_help_is_fast():
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "learner.lrr=3"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "did you mean 'learner.lr'" in r.stderr
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "asyncrl", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generator" in r.stdout
    assert time.perf_counter() - t0 < 1.0, "asyncrl --help must not import torch or vLLM"
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "--print-config", "run.max_steps=7"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "max_steps: 7" in r.stdout
