"""asyncrl: asynchronous actor-learner RL post-training for LLMs over message queues.

The Python API (asyncrl/api.py) is reached from here, `asyncrl.load(...)`, `asyncrl.start(...)`, and
imported only when first used, so that `import asyncrl` (and `asyncrl --help`) stays instant.
"""

__version__ = "0.1.0"

__all__ = ["PromptRecord", "Run", "Task", "launch", "load", "register_reward", "register_task", "start"]


def __getattr__(name: str):
    if name in ("Task", "PromptRecord"):  # what a task of your own is made of (asyncrl/tasks/registry.py)
        from asyncrl.tasks import base, registry

        return registry.Task if name == "Task" else base.PromptRecord
    if name in __all__ or name == "api":
        import importlib

        api = importlib.import_module("asyncrl.api")
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'asyncrl' has no attribute {name!r}")
