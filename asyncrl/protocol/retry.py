"""Redis connection retries for every role: a restarted redis-server is waited for, loudly, not fatal.

redis-py runs every command (and every pipeline) through the client's `Retry` object; these
subclasses retry `ConnectionError` / `TimeoutError` (which include Redis' `LOADING` reply while it
replays its AOF) with capped exponential backoff for up to `give_up_s`, log an error when Redis goes
away and every few seconds while it stays away, and a warning with the downtime when it is back.

A retried command may already have run on the server before the connection broke, so every write
the project retries is idempotent (dedupe keys, compare-and-set Lua scripts, XACK) — see store.py.
`outages()` counts recoveries in this process; readers use it to re-scan what a lost reply may
have delivered (learners/reader.py).

A role told to leave (SIGTERM: asyncrl/launch/leaving.py) calls `leave_by(deadline)`: from then on a lost
Redis is retried only until that deadline, then the call raises, so the role's own drain timeout
bounds its exit, not `redis_retry_s` (600 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError, TimeoutError
from redis.retry import Retry

log = logging.getLogger(__name__)

RETRYABLE = (ConnectionError, TimeoutError)
LOG_EVERY_S = 5.0
_outages = 0
_leave_at: float | None = None  # time.monotonic() past which a failing call stops retrying


def leave_by(deadline: float) -> None:
    """This process is leaving: retry a lost Redis only until `deadline` (time.monotonic())."""
    global _leave_at
    _leave_at = deadline if _leave_at is None else min(_leave_at, deadline)


def leaving() -> bool:
    return _leave_at is not None


def outages() -> int:
    """How many times Redis came back after being unreachable, in this process."""
    return _outages


class _Outage:
    """Bookkeeping of one failing call: when it started, when it was last logged."""

    def __init__(self, give_up_s: float):
        self.give_up_s = give_up_s
        self.t0 = time.monotonic()
        self.last_log = 0.0

    def failed(self, error: Exception, failures: int) -> None:
        now = time.monotonic()
        down = now - self.t0
        if _leave_at is not None and now >= _leave_at:
            log.warning("redis unreachable for %.1fs while leaving: giving up (%s)", down, error)
            raise error
        if down > self.give_up_s:
            log.error("REDIS UNREACHABLE for %.1fs (> buffer.redis_retry_s=%.0f): giving up: %r", down,
                      self.give_up_s, error)
            raise error
        if failures == 1 or now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            log.error("REDIS UNREACHABLE (%s, down %.1fs, attempt %d): retrying with backoff for up to %.0fs",
                      error, down, failures, self.give_up_s)

    def pause_s(self, backoff_s: float) -> float:
        """The backoff, cut short at the leave deadline."""
        if _leave_at is None:
            return backoff_s
        return max(min(backoff_s, _leave_at - time.monotonic()), 0.0)

    def recovered(self, failures: int) -> None:
        global _outages
        _outages += 1
        log.warning("redis is back after %.1fs (%d retries); continuing", time.monotonic() - self.t0, failures)


class LoudRetry(Retry):
    def __init__(self, give_up_s: float = 600.0, base_s: float = 0.05, cap_s: float = 2.0):
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), -1, RETRYABLE)
        self.give_up_s = give_up_s

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures, outage = 0, None
        while True:
            try:
                result = do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                outage = outage or _Outage(self.give_up_s)
                outage.failed(error, failures)
                time.sleep(outage.pause_s(self._backoff.compute(failures)))
                continue
            if outage is not None:
                outage.recovered(failures)
            return result


class AsyncLoudRetry(AsyncRetry):
    def __init__(self, give_up_s: float = 600.0, base_s: float = 0.05, cap_s: float = 2.0):
        super().__init__(ExponentialBackoff(cap=cap_s, base=base_s), -1, RETRYABLE)
        self.give_up_s = give_up_s

    async def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        failures, outage = 0, None
        while True:
            try:
                result = await do()
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                outage = outage or _Outage(self.give_up_s)
                outage.failed(error, failures)
                await asyncio.sleep(outage.pause_s(self._backoff.compute(failures)))
                continue
            if outage is not None:
                outage.recovered(failures)
            return result
