"""The Python API (asyncrl/api.py): configs by path or name with overrides, a reward from a module,
and docs/api.md's example run as written. A run started in the background, followed and stopped:
tests/test_tasks.py, with a task of its own."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncrl
from asyncrl.config import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_import_asyncrl_is_light_and_reaches_the_api():
    probe = "import sys, asyncrl; print(sorted(m for m in ('pydantic', 'torch', 'asyncrl.api') if m in sys.modules))"
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
    assert asyncrl.start is asyncrl.api.start and asyncrl.load is asyncrl.api.load


def test_load_by_name_or_path_with_overrides_as_a_mapping_or_a_list():
    by_name = asyncrl.load("smollm2_arith_cpu", {"run.max_steps": 4, "learner.compile": True,
                                                 "logging.backends": ["jsonl", "tensorboard"]})
    assert by_name.run.max_steps == 4 and by_name.learner.compile is True
    assert by_name.logging.backends == ["jsonl", "tensorboard"]
    by_path = asyncrl.load(REPO / "configs" / "smollm2_arith_cpu.yaml",
                           ["run.max_steps=4", "learner.compile=true", "logging.backends=[jsonl,tensorboard]"])
    assert by_path == by_name
    assert asyncrl.load().run.name == "tiny"
    with pytest.raises(ConfigError, match="did you mean 'learner.lr'"):
        asyncrl.load(None, {"learner.lrr": 1e-3})


def test_start_refuses_overrides_beside_a_config():
    with pytest.raises(ConfigError, match="give overrides to load"):
        asyncrl.start(asyncrl.load(), {"run.max_steps": 2})


def _reward_module(tmp_path, monkeypatch):
    (tmp_path / "api_rewards.py").write_text(
        "def parity(completion, answer, **row):\n"
        "    return 0.75 if len(completion) % 2 else 0.25\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after the test
    import api_rewards

    return api_rewards.parity


def test_register_reward_names_a_module_function_and_puts_its_folder_on_the_path(tmp_path, monkeypatch):
    parity = _reward_module(tmp_path, monkeypatch)
    cfg = asyncrl.register_reward(asyncrl.load(), parity)
    assert cfg.reward.function == "api_rewards:parity"
    assert str(tmp_path) in os.environ["PYTHONPATH"].split(os.pathsep)

    def local(completion, answer, **row):
        return 0.0

    with pytest.raises(ConfigError, match="not a module-level function"):
        asyncrl.register_reward(cfg, local)
    main = type(local)(local.__code__, {}, "main_fn")
    main.__module__ = "__main__"
    with pytest.raises(ConfigError, match="cannot import"):
        asyncrl.register_reward(cfg, main)


@pytest.mark.slow
def test_the_docs_example_runs_as_written(tmp_path):
    text = (REPO / "docs" / "api.md").read_text()
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert len(example.strip().splitlines()) == 5
    r = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["1", "2", "3", "4", "5"] and lines[-1] == "exit code 0"
