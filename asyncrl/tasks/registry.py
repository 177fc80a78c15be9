"""Tasks by name: what `data.task` accepts, the rows the buffer releases, the held-out rows
evaluation asks, and the reward that scores them.

A task is one `Task` in one file: its training rows, its held-out rows, its reward and its settings
check. The built-in ones (a module each, holding `TASK`):

| `data.task` | file | rows | reward (`reward.name`) |
| --- | --- | --- | --- |
| `copy` | asyncrl/tasks/synthetic.py | letter strings drawn from `run.seed` | `copy` |
| `arith` | asyncrl/tasks/arith.py | integer problems; the held-out tenth of the problem space | `arith` |
| `gsm8k` | asyncrl/tasks/gsm8k.py | `data.path`; held out: its test split | `gsm8k` (and `math`) |
| `prompts` | asyncrl/tasks/prompts.py | `data.path`; held out: its test split | none: `reward.*` decides |
| `calc` | asyncrl/envs/calc.py | multiplications; a calculator tool (multi-turn) | the environment's |
| `guess` | asyncrl/envs/guess.py | a secret number; "higher"/"lower" replies (multi-turn) | the environment's |
| `gsm8k_python` | asyncrl/envs/python_tool.py | `data.path` (GSM8K); a sandboxed Python tool (multi-turn) | the environment's |

A task with an `environment` is played as multi-turn episodes (docs/agentic.md): its environment,
made per episode from the row, answers each assistant turn and gives the reward; `reward.*` is not used.

A built-in task's reward is registered under the task's name (`reward.name=arith`); the config
still picks the reward (`reward.name`, `reward.function`, `reward.model`), as it always has.

A task of your own is `data.task=my_pkg.my_tasks:TASK`, a module-level `Task` that every role imports
by that name (the module must be importable in each of them, like `reward.function`'s);
`asyncrl.register_task` sets it from Python and puts the module's folder on `PYTHONPATH`. Its reward,
`fn(completion, answer, prompt=, prompt_id=, group_id=) -> float`, becomes `reward.function` unless
`reward.function` or `reward.model` is set (`reward.name` is then not used).

Only the standard library is imported here; a task's module is imported when it is first asked for.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from asyncrl.registry import ADVANTAGES
from asyncrl.tasks.base import PromptRecord

if TYPE_CHECKING:
    from asyncrl.config import Config

Rows = Callable[["Config"], list[PromptRecord]]

# name -> the module whose `TASK` it is. Adding a built-in task: its file, and its line here.
BUILTIN: dict[str, str] = {
    "copy": "asyncrl.tasks.synthetic",
    "arith": "asyncrl.tasks.arith",
    "gsm8k": "asyncrl.tasks.gsm8k",
    "prompts": "asyncrl.tasks.prompts",
    "calc": "asyncrl.envs.calc",
    "guess": "asyncrl.envs.guess",
    "gsm8k_python": "asyncrl.envs.python_tool",
}
# Rewards that belong to no task (asyncrl/tasks/rewards.py); `math` is the GSM8K reward's other name.
GENERIC_REWARDS = ("math", "exact_match", "format")


@dataclass(frozen=True)
class Task:
    """What a task brings. `train_rows(cfg)` and `eval_rows(cfg)` return `PromptRecord`s (prompt_id,
    prompt, answer); evaluation takes the first `eval.num_prompts` held-out rows. `reward(completion,
    answer, **row)` scores a completion (None: `reward.*` decides). `check(cfg)` returns config
    errors, one line each, naming the key and the fix (empty: the settings are fine).
    `environment(cfg, row)`: an `asyncrl.envs.base.Environment` for one episode of the row; a task
    with one is played as multi-turn episodes, scored by its environment."""

    name: str
    train_rows: Rows
    eval_rows: Rows | None = None
    reward: Callable[..., float] | None = None
    check: Callable[[Config], list[str]] | None = None
    environment: Callable[..., object] | None = None


def task_names() -> tuple[str, ...]:
    return tuple(BUILTIN)


@functools.cache
def get_task(spec: str) -> Task:
    """The task `data.task` names: a built-in name or `module:attribute`. A bad name raises
    ValueError with one line saying what is accepted."""
    if spec in BUILTIN:
        task = importlib.import_module(BUILTIN[spec]).TASK
        assert task.name == spec, f"{BUILTIN[spec]}.TASK is named {task.name!r}, registered as {spec!r}"
        return task
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"data.task={spec!r} is neither a built-in task ({', '.join(BUILTIN)}) nor a task of "
                         "your own written my_pkg.my_tasks:TASK")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"data.task={spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH in "
                         "every process of the run?") from None
    task = getattr(module, attr, None)
    if not isinstance(task, Task):
        raise ValueError(f"data.task={spec!r}: {module_name}.{attr} is {type(task).__name__}, not an "
                         "asyncrl.Task")
    return task


def has_environment(cfg: Config) -> bool:
    """Whether `data.task` is played as multi-turn episodes (its task has an environment)."""
    return get_task(cfg.data.task).environment is not None


def module_function(fn: Callable, who: str) -> str:
    """`module:function` of a module-level function another process can import by that name."""
    qualname = getattr(fn, "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    if module in (None, "__main__") or not getattr(importlib.import_module(module), "__file__", None):
        raise ValueError(f"{who}: {qualname} is defined in {module!r}, which a generator process cannot import; "
                         "put it in a module file (e.g. my_tasks.py) and import it from there")
    if "." in qualname or "<" in qualname:
        raise ValueError(f"{who}: {qualname} is not a module-level function")
    return f"{module}:{qualname}"


def config_errors(cfg: Config) -> list[str]:
    """The task's own settings check, and what every task needs (held-out rows when evaluating).
    A task of your own with a reward sets `reward.function` to it here, unless a reward function or
    model is already set."""
    try:
        task = get_task(cfg.data.task)
    except ValueError as e:
        return [str(e)]
    errors = list(task.check(cfg)) if task.check else []
    if cfg.eval.every > 0 and task.eval_rows is None and not cfg.eval.path:
        errors.append(f"data.task={cfg.data.task} has no held-out rows: set eval.path to a held-out file, or "
                      "eval.every=0")
    if task.environment is not None:
        errors += environment_errors(cfg)
    if cfg.data.task not in BUILTIN and task.reward is not None and not (cfg.reward.function or cfg.reward.model):
        try:
            cfg.reward.function = module_function(task.reward, f"data.task={cfg.data.task}: its reward")
        except ValueError as e:
            errors.append(str(e))
    return errors


def environment_errors(cfg: Config) -> list[str]:
    """What multi-turn episodes need of the rest of the config."""
    errors = []
    if cfg.env.max_tokens and cfg.env.max_tokens >= cfg.generator.max_model_len:
        errors.append(f"env.max_tokens={cfg.env.max_tokens} must be below generator.max_model_len="
                      f"{cfg.generator.max_model_len} (the prompt needs room), or 0 for up to the model length")
    if cfg.generator.backend != "vllm":
        errors.append(f"data.task={cfg.data.task}: multi-turn episodes run on generator.backend=vllm")
    if ADVANTAGES.static_meta(cfg.algorithm.advantage).get("greedy_baseline"):
        errors.append(f"algorithm.advantage={cfg.algorithm.advantage} takes a greedy completion of each prompt as "
                      f"its baseline, which data.task={cfg.data.task}'s episodes do not play: choose another "
                      "advantage (grpo, rloo, ...)")
    return errors


def train_rows(cfg: Config) -> list[PromptRecord]:
    """The rows the buffer releases (`data.task`'s training rows)."""
    rows = get_task(cfg.data.task).train_rows(cfg)
    if not rows:
        raise ValueError(f"data.task={cfg.data.task} gave no training rows")
    return rows


def task_rewards() -> dict[str, Callable[..., float]]:
    """The built-in tasks' rewards, by task name (what `reward.name` accepts besides GENERIC_REWARDS)."""
    return {name: task.reward for name in BUILTIN if (task := get_task(name)).reward is not None}
