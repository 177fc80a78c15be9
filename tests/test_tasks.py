"""Tasks by name (asyncrl/tasks/registry.py): the built-in tasks on the registry, `data.task` refused in
one line when it names nothing, and a task of your own registered from Python (`asyncrl.register_task`)
and run end to end: its rows released by the buffer, its reward scoring in the generator, its held-out
rows evaluated by the learner."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import asyncrl
from asyncrl.config import ConfigError, load_config
from asyncrl.tasks import registry
from asyncrl.tasks.evaluation import load_eval_set
from buffers.service import load_prompts

TASK_MODULE = '''
from asyncrl import PromptRecord, Task


def train_rows(cfg):
    return [PromptRecord(prompt_id=f"mine-{i}", prompt="abc"[: 1 + i % 3] + "=", answer="train")
            for i in range(cfg.data.num_prompts)]


def held_out_rows(cfg):
    return [PromptRecord(prompt_id=f"mine-held-{i}", prompt="cab=", answer="held") for i in range(3)]


def reward(completion, answer, **row):
    if answer == "held":
        return 0.5
    if answer == "train":
        return 0.75 if len(completion) % 2 else 0.25
    return 0.0  # a row of another task


def check(cfg):
    return [] if cfg.data.num_prompts <= 2000 else [f"data.num_prompts must be <= 2000 for mine, got {cfg.data.num_prompts}"]


TASK = Task("mine", train_rows=train_rows, eval_rows=held_out_rows, reward=reward, check=check)
'''


@pytest.fixture
def my_tasks(tmp_path, monkeypatch):
    """A task module of the test's own, importable here and, through PYTHONPATH, in every role."""
    (tmp_path / "my_tasks_mod.py").write_text(TASK_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored after the test
    registry.get_task.cache_clear()
    import my_tasks_mod

    yield my_tasks_mod
    sys.modules.pop("my_tasks_mod", None)
    registry.get_task.cache_clear()


@pytest.mark.parametrize("name,reward", [("copy", "copy"), ("arith", "arith")])
def test_builtin_tasks_give_the_rows_they_gave_before(name, reward):
    from asyncrl.tasks.arith import eval_set, train_set
    from asyncrl.tasks.synthetic import copy_dataset

    cfg = load_config(None, [f"data.task={name}", f"reward.name={reward}", "data.num_prompts=20",
                             "eval.num_prompts=5"])
    if name == "copy":
        want_train = copy_dataset(20, seed=0)
        want_eval = copy_dataset(5, seed=104_729)
    else:
        want_train, want_eval = train_set(cfg), eval_set(cfg)
    assert load_prompts(cfg) == want_train and load_eval_set(cfg) == want_eval
    from asyncrl.tasks.rewards import REGISTRY

    assert registry.get_task(name).reward is REGISTRY[reward]


def test_builtin_task_rewards_are_reward_names():
    assert set(registry.task_rewards()) == {"copy", "arith", "gsm8k"}
    assert set(registry.BUILTIN) == {"copy", "arith", "gsm8k", "prompts", "calc", "guess", "gsm8k_python"}
    cfg = load_config(None, ["reward.name=arith"])
    assert cfg.reward.name == "arith"


@pytest.mark.parametrize("spec,message", [
    ("nope", "data.task='nope' is neither a built-in task (copy, arith, gsm8k, prompts, calc, guess, gsm8k_python) nor a task of your own"),
    ("no_such_module_xyz:TASK", "data.task='no_such_module_xyz:TASK': cannot import 'no_such_module_xyz'"),
    ("asyncrl.tasks.arith:check", "asyncrl.tasks.arith.check is function, not an asyncrl.Task"),
])
def test_a_bad_task_is_one_line(spec, message):
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", f"data.task={spec}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_register_task_names_the_module_and_checks_its_settings(my_tasks):
    cfg = asyncrl.register_task(asyncrl.load(None, {"eval.every": 2}), my_tasks.TASK)
    assert cfg.data.task == "my_tasks_mod:TASK" and cfg.reward.function == "my_tasks_mod:reward"
    assert [r.prompt_id for r in load_prompts(cfg)][:2] == ["mine-0", "mine-1"]
    assert [r.answer for r in load_eval_set(cfg)] == ["held"] * 3
    # A reward set explicitly stays.
    cfg = asyncrl.load(None, {"reward.function": "my_tasks_mod:train_rows"})
    assert asyncrl.register_task(cfg, my_tasks.TASK).reward.function == "my_tasks_mod:train_rows"
    with pytest.raises(ConfigError, match="data.num_prompts must be <= 2000 for mine, got 3000"):
        load_config(None, ["data.task=my_tasks_mod:TASK", "data.num_prompts=3000"])
    with pytest.raises(ConfigError, match="not a module-level name"):
        asyncrl.register_task(asyncrl.load(), asyncrl.Task("loose", train_rows=my_tasks.train_rows))
    with pytest.raises(ConfigError, match="has no held-out rows: set eval.path"):
        import my_tasks_mod

        my_tasks_mod.NO_EVAL = asyncrl.Task("no_eval", train_rows=my_tasks.train_rows)
        asyncrl.register_task(asyncrl.load(None, {"eval.every": 1}), my_tasks_mod.NO_EVAL)


@pytest.mark.slow
def test_a_registered_task_runs_end_to_end_followed_and_stopped_from_python(my_tasks, tmp_path, monkeypatch,
                                                                            tiny_model):
    """The Python API end to end: a task of your own registered (its reward with it), the run
    started in the background, its rows followed as they come, the run stopped as Ctrl-C does."""
    monkeypatch.chdir(tmp_path)
    cfg = asyncrl.load(None, {"model.path": tiny_model, "run.max_steps": 1000, "data.num_prompts": 64,
                              "eval.every": 2, "eval.k": 0, "eval.before_train": False, "checkpoint.export_hf": False})
    cfg = asyncrl.register_task(cfg, my_tasks.TASK)
    evaluations = cfg.run_dir / "eval.jsonl"
    run = asyncrl.start(cfg)
    rows = []
    try:
        for row in run.follow(timeout_s=600):
            rows.append(row)
            if len(rows) >= 3 and evaluations.exists() and evaluations.read_text().strip():
                break
        assert len(rows) >= 3, run.output()[-3000:]
        assert run.stop() == 130  # as Ctrl-C: every role torn down
    finally:
        if run.running:
            run.stop()
    assert [row["step"] for row in rows] == list(range(1, len(rows) + 1))
    assert f"step={len(rows):>4}" in run.output()
    assert run.metrics()[:len(rows)] == rows
    # The buffer released the task's rows and the generator scored them with its reward (0.25 or 0.75
    # on a training row, 0 on anyone else's).
    assert all({row["reward_min"], row["reward_max"]} <= {0.25, 0.75} for row in rows), rows
    # The learner evaluated the task's three held-out rows (answer "held": 0.5), not eval.num_prompts of another set.
    evaluated = json.loads(evaluations.read_text().splitlines()[0])
    assert evaluated["eval/num_prompts"] == 3 and evaluated["eval/greedy_reward"] == 0.5, evaluated
