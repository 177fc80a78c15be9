"""The chaos soak's reward (benchmarks/chaos_soak.py): the copy task's reward, slowed on demand.

`reward.function=benchmarks.chaos_reward:slow_copy`. While the file named by the environment
variable CHAOS_SOAK_SLOW_REWARD exists, a call sleeps on a fraction of calls; the file holds
`fraction max_seconds` (e.g. `0.3 2.0`: 30% of calls sleep up to 2 s). The soak creates and
removes the file to open and close a slow-reward window in every generator at once.
"""

from __future__ import annotations

import os
import random
import time

from asyncrl.tasks.synthetic import copy_reward

_rng = random.Random()


def _slow_settings() -> tuple[float, float] | None:
    path = os.environ.get("CHAOS_SOAK_SLOW_REWARD", "")
    if not path:
        return None
    try:
        fraction, max_s = (float(x) for x in open(path).read().split()[:2])
    except (OSError, ValueError):
        return None  # no window open (or a half-written file: the next call reads it again)
    return fraction, max_s


def slow_copy(completion: str, answer: str, **row) -> float:
    """`copy_reward`, after a sleep of up to `max_seconds` on `fraction` of the calls while a window is open."""
    settings = _slow_settings()
    if settings is not None and _rng.random() < settings[0]:
        time.sleep(_rng.uniform(0.1, settings[1]))
    return copy_reward(completion, answer)
