"""Rewards: rule-based ones by name, a user function by dotted path, or a reward model.

The names: each built-in task's reward under the task's name (`copy`, `arith`, `gsm8k`; the task
registry, asyncrl/tasks/registry.py), and `math` (the GSM8K check), `exact_match`, `format`.

Each reward takes (completion text, reference answer) and returns a float. `reward.function=pkg.mod:fn`
loads a user function called as fn(completion, answer, **row) (row: prompt, prompt_id, group_id);
`reward.model=PATH` scores prompt+completion with a Hugging Face sequence-classification model, one
batch per group (asyncrl/tasks/reward_model.py). `score_group` scores a group: it catches every error per
sample, so a broken reward costs that sample's score (0.0, counted and logged), never the generator.
The generator calls it through `RewardPool`, on `reward.workers` threads off its event loop, so a slow
reward (a reward model, a symbolic check) does not stall heartbeats, weight syncs or leases.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from asyncrl.tasks.math_reward import MathReward, gsm8k_reward
from asyncrl.tasks.registry import task_rewards

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]



def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 when the completion equals the answer after stripping surrounding whitespace."""
    return float(completion.strip() == answer.strip())


class FormatReward:
    """1.0 when the whole completion matches `pattern` (re.DOTALL), else 0.0."""

    def __init__(self, pattern: str):
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as e:
            raise ValueError(f"reward.format_regex={pattern!r} is not a valid regular expression: {e}") from e

    def __call__(self, completion: str, answer: str) -> float:
        return float(self.regex.fullmatch(completion) is not None)


REGISTRY: dict[str, RewardFn] = {
    **task_rewards(),
    "exact_match": exact_match_reward,
    "math": gsm8k_reward,
}
MATH_REWARDS = ("gsm8k", "math")


def get_reward(name: str) -> RewardFn:
    if name not in REGISTRY:
        raise ValueError(f"reward.name={name!r} is not registered; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name]


def build_reward(reward_cfg) -> RewardFn:
    """The reward `reward.*` names, with its options (extraction mode, format bonus) applied."""
    if reward_cfg.function:
        return UserReward(reward_cfg.function)
    if reward_cfg.model:
        from asyncrl.tasks.reward_model import RewardModel

        return RewardModel(reward_cfg.model, batch_size=reward_cfg.model_batch_size)
    if reward_cfg.name == "format":
        return FormatReward(reward_cfg.format_regex)
    if reward_cfg.name in MATH_REWARDS:
        return MathReward(extract=reward_cfg.extract, format_bonus=reward_cfg.format_bonus,
                          use_math_verify=reward_cfg.math_verify)
    return get_reward(reward_cfg.name)


def is_correct(reward_fn: RewardFn, completion: str, answer: str) -> bool:
    """Correctness for evaluation: the reward's own `correct()` where it has one, else reward >= 1."""
    if hasattr(reward_fn, "correct"):
        return bool(reward_fn.correct(completion, answer))
    return float(reward_fn(completion, answer)) >= 1.0 - 1e-6


class UserReward:
    """`reward.function=pkg.mod:fn`: fn(completion, answer, **row) -> float, imported at start."""

    def __init__(self, dotted: str):
        module_name, _, attr = dotted.partition(":")
        if not module_name or not attr:
            raise ValueError(f"reward.function={dotted!r} must look like my_pkg.module:function")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"reward.function={dotted!r}: cannot import {module_name!r} ({e}); is it on "
                             "PYTHONPATH in every generator process?") from e
        self.fn = getattr(module, attr, None)
        if not callable(self.fn):
            raise ValueError(f"reward.function={dotted!r}: {module_name} has no function {attr!r}")
        self.name = dotted

    def __call__(self, completion: str, answer: str, **row) -> float:
        return float(self.fn(completion, answer, **row))


def score_group(reward_fn: RewardFn, completions: list[str], answer: str, row: dict) -> tuple[list[float], int]:
    """Scores one group; returns (rewards, number of samples whose reward raised, scored 0.0).

    A batched reward (one with `score_batch`, e.g. the reward model) scores the group at once; if the
    batch fails, each sample is scored alone so one bad sample cannot zero the others.
    """
    group_id = row.get("group_id", "?")
    if hasattr(reward_fn, "score_batch"):
        try:
            return [float(r) for r in reward_fn.score_batch(completions, answer, **row)], 0
        except Exception as e:  # fall back to one by one, counting per sample
            log.warning("batched reward failed on group=%s: %r; scoring samples one by one", group_id, e)
    takes_row = isinstance(reward_fn, UserReward) or hasattr(reward_fn, "score_batch")
    rewards, errors = [], 0
    for i, text in enumerate(completions):
        try:
            rewards.append(float(reward_fn(text, answer, **row) if takes_row else reward_fn(text, answer)))
        except Exception as e:  # a user reward must never take the generator down
            errors += 1
            rewards.append(0.0)
            log.warning("reward error on group=%s sample=%d: %r", group_id, i, e)
    return rewards, errors


class RewardPool:
    """Scores groups on a bounded pool of `workers` threads instead of the caller's event loop.

    Threads, not processes: a user function or a reward model is used as loaded, unpickled. A reward
    that spends its time in native code (a model's forward, a regex, sympy's C parts, I/O) runs beside
    the loop; pure-Python work still shares the interpreter, but the loop keeps its turn (the
    interpreter switches threads every few milliseconds), so heartbeats and syncs are late by a few
    switch intervals per busy thread, not by the reward's time. Groups beyond `workers` wait their
    turn in the pool."""

    def __init__(self, reward_fn: RewardFn, workers: int):
        self.reward_fn = reward_fn
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward")

    async def score(self, completions: list[str], answer: str, row: dict) -> tuple[list[float], int]:
        return await self.call(score_group, self.reward_fn, completions, answer, row)

    async def call(self, fn: Callable, *args):
        """`fn(*args)` on a reward thread (other scoring, e.g. an evaluation round's)."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def shutdown(self) -> None:
        """Returns at once: queued groups are dropped, a reward still running finishes in its thread."""
        self.pool.shutdown(wait=False, cancel_futures=True)
