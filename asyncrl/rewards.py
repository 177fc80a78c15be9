"""Reward functions by name. Each takes (completion text, reference answer) and returns a float."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.math_reward import MathReward, gsm8k_reward
from asyncrl.tasks import copy_reward

RewardFn = Callable[[str, str], float]

REGISTRY: dict[str, RewardFn] = {
    "copy": copy_reward,
    "gsm8k": gsm8k_reward,
    "math": gsm8k_reward,
}
MATH_REWARDS = ("gsm8k", "math")


def get_reward(name: str) -> RewardFn:
    if name not in REGISTRY:
        raise ValueError(f"reward.name={name!r} is not registered; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name]


def build_reward(reward_cfg) -> RewardFn:
    """The reward `reward.*` names, with its options (extraction mode, format bonus) applied."""
    if reward_cfg.name in MATH_REWARDS:
        return MathReward(extract=reward_cfg.extract, format_bonus=reward_cfg.format_bonus,
                          use_math_verify=reward_cfg.math_verify)
    return get_reward(reward_cfg.name)


def is_correct(reward_fn: RewardFn, completion: str, answer: str) -> bool:
    """Correctness for evaluation: the reward's own `correct()` where it has one, else reward >= 1."""
    if hasattr(reward_fn, "correct"):
        return bool(reward_fn.correct(completion, answer))
    return float(reward_fn(completion, answer)) >= 1.0 - 1e-6
