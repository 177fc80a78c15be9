"""The learner's weight pushes, off its critical path (learner rank 0).

A push is staged on the learner's thread: the weights are gathered and copied into one of the
sender's two flat buffers (`WeightSender.stage`). The send (announcement, broadcast or ipc handles,
the members' confirmation) runs on a thread of its own, while the learner goes on with its next step.
At most one send is in flight: the next version is staged into the other buffer meanwhile, and its
send starts only once the previous one has returned, so members see every announcement in order and
a buffer is written again only after every member has it. With `weights.overlap=false`, or at
staleness 0, the learner waits for each send at once.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field


@dataclass
class Push:
    version: int
    future: Future
    started_at: float = field(default_factory=time.time)


@dataclass
class PushResult:
    version: int
    sums: list[int] | None  # None: it failed
    error: str
    started_at: float  # wall time: submitted
    done_at: float  # wall time: the members had it (or it failed)
    waited_s: float  # how long the learner waited for it


class PushQueue:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-push")
        self.inflight: Push | None = None
        self.next_slot = 0

    def submit(self, version: int, send, *args) -> None:
        """Starts `send(*args)` (returns the bucket checksums) on the push thread; the previous push
        must have been collected (`collect`)."""
        assert self.inflight is None, "a push is still in flight"
        self.inflight = Push(version, self._pool.submit(self._timed, send, *args))
        self.next_slot ^= 1

    @staticmethod
    def _timed(send, *args):
        return send(*args), time.time()

    def collect(self, block: bool = True) -> PushResult | None:
        """The push in flight once it has finished (waiting for it when `block`), else None."""
        push = self.inflight
        if push is None or (not block and not push.future.done()):
            return None
        t0 = time.perf_counter()
        self.inflight = None
        try:
            sums, done_at = push.future.result()
            error = ""
        except Exception as e:  # noqa: BLE001 - the caller logs it and drops the group
            sums, done_at, error = None, time.time(), f"{type(e).__name__}: {e}"
        return PushResult(push.version, sums, error, push.started_at, done_at, time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
