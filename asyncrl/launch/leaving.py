"""SIGTERM ends a role within its drain timeout, whether Redis answers or not.

On the first SIGTERM (or SIGINT) the role's own stop callback runs (it finishes what it holds and
leaves), and two bounds start:
- Redis calls that fail from now on are retried only until shortly before the timeout
  (asyncrl/protocol/retry.py `leave_by`), then raise: the role leaves instead of retrying for
  `buffer.redis_retry_s` (600 s by default);
- a call that cannot even fail in time (a frozen redis-server holds a read for `socket_timeout`)
  is cut short by a daemon timer that logs one line and ends the process at the timeout.

A second signal while leaving ends the process at once. A process ended so takes its children with it
(`kill_children`: vLLM's engine core, torchrun's ranks), which would otherwise live on orphaned.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from asyncrl.protocol import retry

log = logging.getLogger(__name__)

# Of the drain timeout, this much (at most half of it) is kept for closing sockets and the last log
# line after Redis calls have given up.
TEARDOWN_S = 2.0
FORCED_EXIT = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


class Leaving:
    """Signal handlers of one role process; `install()` them once its stop callback exists."""

    def __init__(self, role: str, timeout_key: str, timeout_s: float, stop: Callable[[], None],
                 margin_s: float = 0.0):
        """Gone within `timeout_s` (the config field `timeout_key`) + `margin_s` of the first signal;
        the margin is a role's fixed allowance past its configured timeout (a generator's: leaving
        its weight group and shutting its engine down after the drain)."""
        self.role, self.timeout_key, self.configured_s, self.margin_s = role, timeout_key, timeout_s, margin_s
        self.timeout_s = timeout_s + margin_s
        self.stop = stop
        self.since: float | None = None  # time.monotonic() of the first signal
        self._timer: threading.Timer | None = None

    def install(self) -> Leaving:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        return self

    @property
    def deadline(self) -> float | None:
        """time.monotonic() by which the role is gone; None before the first signal."""
        return None if self.since is None else self.since + self.timeout_s

    def on_signal(self, signum: int, _frame=None) -> None:
        if self.since is not None:
            log.warning("%s: second signal %d while leaving: exiting now", self.role, signum)
            self._exit()
        self.begin(signum)
        self.stop()

    def begin(self, signum: int = signal.SIGTERM) -> None:
        """Starts the two bounds (also for an asyncio loop's handler, which calls this itself)."""
        if self.since is not None:
            return
        self.since = time.monotonic()
        retry.leave_by(self.since + max(self.timeout_s - TEARDOWN_S, self.timeout_s / 2))
        # A little before the timeout, so the exit itself lands inside it.
        self._timer = threading.Timer(max(self.timeout_s - 0.5, 0.9 * self.timeout_s), self._overdue)
        self._timer.daemon = True
        self._timer.start()
        margin = f" + {self.margin_s:.0f}s" if self.margin_s else ""
        log.info("%s: signal %d: leaving within %s=%.0fs%s", self.role, signum, self.timeout_key, self.configured_s,
                 margin)

    def cancel(self) -> None:
        """The role has left in time: the timer must not fire during the interpreter's exit."""
        if self._timer is not None:
            self._timer.cancel()

    def _overdue(self) -> None:
        margin = f" + {self.margin_s:.0f}s" if self.margin_s else ""
        log.warning("%s: not gone within %s=%.0fs%s of the signal (Redis unreachable?): exiting now", self.role,
                    self.timeout_key, self.configured_s, margin)
        self._exit()

    @staticmethod
    def _exit() -> None:
        try:
            kill_children()
        except Exception:  # noqa: BLE001 - the exit goes ahead whatever the cleanup met
            pass
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FORCED_EXIT)


def child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


def kill_children(keep: set[int] = frozenset()) -> list[int]:
    """SIGKILLs this process's children not in `keep` (those that were there before the engine),
    with all their descendants, except multiprocessing's resource tracker (it unlinks shared memory
    the engine leaves); returns the pids it killed."""
    from multiprocessing import resource_tracker

    import psutil

    keep = set(keep) | {getattr(resource_tracker._resource_tracker, "_pid", None)}
    children, victims = [], []
    for child in psutil.Process().children():
        if child.pid in keep:
            continue
        try:
            victims += [*child.children(recursive=True), child]
            children.append(child)
        except psutil.Error:  # gone already
            pass
    killed = []
    for proc in victims:
        try:
            proc.kill()
            killed.append(proc)
        except psutil.Error:  # gone already, or not ours to kill
            pass
    # Reaps the direct children (a process already gone is fine), not the grandchildren: those are
    # not ours to reap, and waiting until whoever adopts them has reaped them only delays the exit.
    psutil.wait_procs([p for p in killed if p in children], timeout=5)
    return [p.pid for p in killed]
