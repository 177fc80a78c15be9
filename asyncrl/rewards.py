"""Reward functions by name. Each takes (completion text, reference answer) and returns a float."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.tasks import copy_reward

RewardFn = Callable[[str, str], float]

REGISTRY: dict[str, RewardFn] = {
    "copy": copy_reward,
}


def get_reward(name: str) -> RewardFn:
    if name not in REGISTRY:
        raise ValueError(f"reward.name={name!r} is not registered; choose one of {sorted(REGISTRY)}")
    return REGISTRY[name]
