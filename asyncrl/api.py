"""The Python API: what `asyncrl run` does, from a notebook or a script.

    import asyncrl
    cfg = asyncrl.load("tiny", {"run.max_steps": 5})     # a file, a shipped config's name, or None
    cfg = asyncrl.register_task(cfg, my_tasks.TASK)      # optional: a task of your own (asyncrl.Task)
    run = asyncrl.start(cfg)                             # the launcher, in a process of its own
    for row in run.follow():                             # each learner step's metrics row
        print(row["step"], row["reward_mean"])
    run.wait()                                           # the launcher's exit code (0: done)

`start` runs the same launcher as `asyncrl run` (`python -m asyncrl run` on the resolved config), in
its own process: the launcher supervises its children with signal handlers, which only a main
thread may install, and a notebook's kernel must not be torn down with the run. `launch` runs it in
this process and blocks; it is what the CLI's `run` calls. Only the config module is imported here,
and it only when used, so `import asyncrl` stays instant.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.tasks.registry import Task

Overrides = Sequence[str] | Mapping[str, Any] | None


def _override_list(overrides: Overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={_text(value)}" for key, value in overrides.items()]
    return list(overrides)


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(map(_text, value)) + "]"
    return str(value)


def load(config: str | Path | None = None, overrides: Overrides = None) -> Config:
    """A checked config: `config` is a YAML file, a shipped config's name (`asyncrl configs`) or None
    (the CPU demo, tiny); `overrides` are dotted keys, `["run.max_steps=5"]` or `{"run.max_steps": 5}`.
    A mistake raises `asyncrl.config.ConfigError` naming the key and the fix."""
    from asyncrl.config import load_config

    return load_config(config, _override_list(overrides))


def _module_on_path(module_name: str) -> None:
    """Puts the folder `module_name` is imported from on PYTHONPATH, which every role of a run started
    from this process inherits."""
    root = Path(sys.modules[module_name].__file__).resolve().parent
    for _ in module_name.split(".")[1:]:  # a package's module: the folder above the package
        root = root.parent
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *paths])


def register_reward(cfg: Config, fn: Callable[..., float]) -> Config:
    """Makes `fn(completion, answer, prompt=, prompt_id=, group_id=) -> float` the run's reward
    (`reward.function=module:fn`). Generators are processes of their own that import it by name, so
    `fn` must live in a module file (not a notebook cell or the script being run); its folder is put
    on this process's PYTHONPATH, which every role of a run started here inherits. Returns `cfg`, changed."""
    from asyncrl.config import ConfigError
    from asyncrl.tasks.registry import module_function

    try:
        cfg.reward.function = module_function(fn, "register_reward")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _module_on_path(fn.__module__)
    return cfg


def register_task(cfg: Config, task: Task) -> Config:
    """Makes `task` (an `asyncrl.Task`: training rows, held-out rows, reward, settings check) the run's
    task: `data.task=module:NAME`, and its reward `reward.function` unless a reward function or model
    is set. Every role imports the task by that name, so the `Task` must be a module-level name of a
    module file, beside its functions; the module's folder is put on PYTHONPATH as for
    `register_reward`. The config is checked again (the task's own check included). Returns `cfg`, changed."""
    from asyncrl.config import ConfigError
    from asyncrl.tasks.registry import Task

    if not isinstance(task, Task):
        raise ConfigError(f"register_task: expected an asyncrl.Task, got {type(task).__name__}")
    spec = _module_name_of(task)
    if spec is None:
        raise ConfigError(f"register_task: task {task.name!r} is not a module-level name of the module file its "
                          "functions live in (e.g. TASK = Task(...) in my_tasks.py, imported from there)")
    _module_on_path(spec.partition(":")[0])
    cfg.data.task = spec
    return cfg.validate()


def _module_name_of(task: Any) -> str | None:
    """`module:NAME` where `module` (one of those the task's functions come from, a file) binds NAME to `task`."""
    for fn in (task.train_rows, task.eval_rows, task.reward, task.check):
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is None or module.__name__ == "__main__" or not getattr(module, "__file__", None):
            continue
        name = next((k for k, v in vars(module).items() if v is task), None)
        if name is not None:
            return f"{module.__name__}:{name}"
    return None


def launch(cfg: Config) -> int:
    """Runs the whole run in this process (local Redis, buffer, generators, learner) and blocks until
    it ends; the launcher's exit code (0: done, 130: interrupted, 3: stalled with run.on_stall=fail).
    What `asyncrl run` calls; it installs SIGINT/SIGTERM handlers, so call it from a main thread."""
    from asyncrl.launch.affinity import ROLES, check_available
    from asyncrl.launch.launcher import Launcher
    from asyncrl.launch.preflight import check_all

    check_available(cfg, ROLES)  # checks only: the launcher pins each child, never itself
    check_all(cfg, redis_required=False, model=True)  # an empty buffer.redis_url: the launcher starts one
    return Launcher(cfg).run()


class Run:
    """A run started by `start`: its launcher process, its run folder, its metrics rows."""

    def __init__(self, cfg: Config, proc: subprocess.Popen, scratch: Path, earlier_stamp: int | None):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.proc = proc
        self.output_path = scratch / "launcher.log"  # the launcher's stdout and stderr
        self._earlier_stamp = earlier_stamp  # config.yaml's mtime from an earlier run in this folder

    @property
    def running(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        """What the launcher printed so far (the step lines, the start-up line, errors)."""
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    def metrics(self) -> list[dict]:
        """Every step's metrics row this run has written so far (`{run_dir}/metrics.jsonl`)."""
        started = self.run_dir / "config.yaml"
        # The launcher sets an earlier run's metrics.jsonl aside before it writes config.yaml.
        if not started.exists() or started.stat().st_mtime_ns == self._earlier_stamp:
            return []
        from asyncrl.observe.metrics import complete_rows

        return complete_rows(self.run_dir / "metrics.jsonl")

    def follow(self, poll_s: float = 0.5, timeout_s: float | None = None) -> Iterator[dict]:
        """Yields each new metrics row as the learner writes it, until the run ends (or `timeout_s`)."""
        seen = 0
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            done = not self.running
            rows = self.metrics()
            yield from rows[seen:]
            seen = len(rows)
            if done or (deadline is not None and time.monotonic() > deadline):
                return
            time.sleep(poll_s)

    def wait(self, timeout_s: float | None = None) -> int:
        """Blocks until the launcher exits; its exit code. Raises subprocess.TimeoutExpired."""
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ends the run as Ctrl-C does (every role torn down; exit code 130), killing it after `timeout_s`."""
        if self.running:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                from asyncrl.launch.launcher import kill_tree

                kill_tree(self.proc.pid, signal.SIGKILL)
        return self.proc.wait()

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start(config: Config | str | Path | None = None, overrides: Overrides = None) -> Run:
    """Starts a run in the background with the launcher `asyncrl run` uses, and returns at once.
    `config`: a Config from `load` (then `overrides` must be empty), a file, a shipped name or None."""
    from asyncrl.config import Config, ConfigError, dump_yaml

    if isinstance(config, Config):
        if overrides:
            raise ConfigError("start: give overrides to load(), not with a Config")
        cfg = config
    else:
        cfg = load(config, overrides)
    scratch = Path(tempfile.mkdtemp(prefix=f"asyncrl-{cfg.run.name}-"))
    config_file = scratch / "config.yaml"
    config_file.write_text(dump_yaml(cfg))
    earlier = cfg.run_dir / "config.yaml"
    earlier_stamp = earlier.stat().st_mtime_ns if earlier.exists() else None
    with open(scratch / "launcher.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", str(config_file)], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return Run(cfg, proc, scratch, earlier_stamp)
