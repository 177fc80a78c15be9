"""The start-up timeline: when each role reached each milestone, in the Redis hash `timeline`.

Each role writes its own milestones (wall-clock seconds) as it reaches them: the launcher `launch`
(its process's start), a generator `{id} process` (its process's start) and `{id} engine` (vLLM up,
CUDA graphs captured), the learner `learner process`, `learner ready` (model built and sharded) and,
once each, `first batch`, `first step` and `first push` (the first version every member holds). The
learner prints the timeline after its first step (`startup:` line), `asyncrl status` shows it, and
`docs/metrics.md` lists the names. A fresh run's launcher clears the hash with the rest of the run's
keys; milestones of roles started by hand are relative to the earliest one.
"""

from __future__ import annotations

import os
import time


def process_start() -> float:
    """This process's start (wall clock), so that a milestone counts the interpreter's and the imports'
    time too; now where it cannot be read."""
    try:
        import psutil

        return psutil.Process(os.getpid()).create_time()
    except Exception:  # noqa: BLE001 - a timeline entry is never worth failing a role
        return time.time()


def mark(client, keys, what: str, t: float | None = None) -> None:
    """Records milestone `what` (a sync or asyncio Redis client: the caller awaits the latter's result)."""
    return client.hset(keys.timeline, what, f"{time.time() if t is None else t:.3f}")


def parse(raw: dict) -> dict[str, float]:
    out = {}
    for k, v in (raw or {}).items():
        try:
            out[k.decode() if isinstance(k, bytes) else k] = float(v)
        except (TypeError, ValueError):
            continue  # a malformed entry: left out, never fatal to a reader
    return out


def describe(marks: dict[str, float]) -> str:
    """`launch +0.0s, g0 process +0.4s, ...` in time order, from `launch` or the earliest milestone."""
    if not marks:
        return "no milestones recorded"
    origin = marks.get("launch", min(marks.values()))
    return ", ".join(f"{k} +{v - origin:.1f}s" for k, v in sorted(marks.items(), key=lambda kv: kv[1]))
