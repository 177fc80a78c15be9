"""Shipped configs are found by name from any directory; paths are read as given."""

import subprocess
import sys

import pytest

from asyncrl.config import PACKAGED_CONFIGS, REPO_CONFIGS, ConfigError, load_config, shipped_configs


def test_every_checkout_config_ships_under_its_name():
    assert set(shipped_configs()) == {p.stem for p in REPO_CONFIGS.glob("*.yaml")} >= {"tiny", "smollm2_arith"}


def test_a_name_loads_the_shipped_config_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    by_path = load_config(REPO_CONFIGS / "smollm2_arith.yaml")
    for name in ("smollm2_arith", "smollm2_arith.yaml"):
        assert load_config(name) == by_path
    # Relative paths inside it stay relative to the working directory.
    assert load_config("smollm2_arith").model.path == "models/smollm2-135m-instruct"


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text((PACKAGED_CONFIGS / "tiny.yaml").read_text().replace("max_steps: 30",
                                                                                            "max_steps: 7"))
    assert load_config("tiny.yaml").run.max_steps == 7
    assert load_config("tiny").run.max_steps == 30  # `tiny` is no file here: the shipped one


def test_an_unknown_name_says_what_ships_and_the_closest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"neither a file nor a shipped config .*did you mean 'smollm2_arith'"):
        load_config("smollm2_arit")
    with pytest.raises(ConfigError, match="does not exist"):  # a path is never read as a name
        load_config("configs/smollm2_arith.yaml")


def test_asyncrl_configs_lists_names_with_descriptions_and_prints_one(tmp_path):
    r = subprocess.run([sys.executable, "-m", "asyncrl", "configs"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split(None, 1) for line in r.stdout.splitlines())
    assert set(rows) == set(shipped_configs())
    assert rows["tiny"] == "The embedded default: `asyncrl run` with no arguments"
    assert all(rows.values())
    r = subprocess.run([sys.executable, "-m", "asyncrl", "configs", "smollm2_arith_cpu"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == (REPO_CONFIGS / "smollm2_arith_cpu.yaml").read_text()
    r = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", "tiny_gsm8k"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "run tiny_gsm8k" in r.stdout, r.stderr


def test_every_shipped_config_of_a_long_run_writes_checkpoints():
    """A run of 100 steps or more (the GPU configs) can be resumed: it writes checkpoints."""
    long_runs = {name: load_config(path) for name, path in shipped_configs().items()}
    long_runs = {name: cfg for name, cfg in long_runs.items() if cfg.run.max_steps >= 100}
    assert {"smollm2_arith", "gsm8k_grpo_qwen2.5_0.5b"} <= set(long_runs)
    assert all(0 < cfg.checkpoint.every <= cfg.run.max_steps for cfg in long_runs.values()), \
        {name: cfg.checkpoint.every for name, cfg in long_runs.items()}


def test_every_cpu_config_of_a_real_model_or_an_episode_says_what_it_shows():
    """The short CPU runs of real models and agentic tasks print reward 0 and loss 0 at every step: each
    says in its own output (run.purpose, printed at the start and the end) that it checks the path."""
    configs = {name: load_config(path) for name, path in shipped_configs().items()}
    short = {name: cfg for name, cfg in configs.items()
             if name.endswith("_cpu") and (cfg.model.path or cfg.data.task in ("guess", "calc", "gsm8k_python"))}
    assert {"smollm2_arith_cpu", "guess_cpu", "calc_cpu", "gsm8k_python_cpu"} <= set(short)
    for name, cfg in short.items():
        assert cfg.run.purpose.startswith("a path check, not learning"), name
