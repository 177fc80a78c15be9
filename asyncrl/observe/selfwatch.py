"""Each role's own stall check: a role started by hand (no launcher, so no watchdog) still says when
it has stopped moving, what it waits on and for how long.

A role marks `progress()` when it moves (the learner steps, the buffer stores a group, a generator
pushes one) and, while it waits, calls `check(what, reason)` now and then. Once the wait passes
`run.stall_timeout_s` the stall is reported once: an ERROR line in the role's log
(`STALL learner: no_step for 31.0s: waiting for data: ...`), a `stall` event, and the fields
`stall`, `stall_what`, `stall_since` for the role's own record (the `learner` hash, the buffer's
`metrics` hash as `buffer:stall...`, a generator's heartbeat), which `asyncrl status` shows. When the
role moves again the fields are cleared and a `stall_resolved` event logged.

Start-up is not a stall: before the first progress the bound is at least STARTUP_S (vLLM's start-up
can take minutes), as in the launcher's watchdog.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncrl.observe.watchdog import Stall
from asyncrl.protocol.keys import Keys, log_event

log = logging.getLogger(__name__)

STARTUP_S = 300.0
CLEARED = {"stall": "", "stall_what": "", "stall_since": 0.0}


class SelfWatch:
    def __init__(self, role: str, timeout_s: float, client=None, keys: Keys | None = None,
                 publish: Callable[[dict], None] | None = None):
        """`publish(fields)`: writes the stall fields into the role's own record (called on a stall
        and when it resolves); `client`/`keys`: where the events go (none: log only)."""
        self.role, self.timeout_s = role, timeout_s
        self.client, self.keys, self.publish = client, keys, publish
        self.last = time.monotonic()  # the last progress (or the start)
        self.moved = False  # any progress yet
        self.current: Stall | None = None
        self.since_wall = time.time()

    def progress(self) -> Stall | None:
        """The role moved; returns the stall this resolves, if any."""
        self.last, self.since_wall, self.moved = time.monotonic(), time.time(), True
        if self.current is None:
            return None
        stall, self.current = self.current, None
        log.warning("%s moves again (was stalled: %s)", self.role, stall.what)
        self._event("stall_resolved", role=self.role, what=stall.what)
        if self.publish is not None:
            self.publish(dict(CLEARED))
        return stall

    def hold(self) -> None:
        """Nothing can move yet (nobody to wait on): the clock restarts, without counting as progress."""
        self.last = time.monotonic()

    def waited_s(self) -> float:
        return time.monotonic() - self.last

    def bound_s(self) -> float:
        return self.timeout_s if self.moved else max(self.timeout_s, STARTUP_S)

    def check(self, what: str, reason: Callable[[], str]) -> Stall | None:
        """The stall, the first time the wait since the last progress passes the bound (else None).
        `reason()` is called only then: it may read Redis."""
        if self.timeout_s <= 0 or self.current is not None:
            return None
        waited = self.waited_s()
        if waited <= self.bound_s():
            return None
        self.current = Stall(self.role, what, waited, reason())
        log.error("%s", self.current.line())
        self._event("stall", role=self.role, what=what, since_s=f"{waited:.1f}", reason=self.current.reason,
                    source="self")
        if self.publish is not None:
            self.publish(self.fields())
        return self.current

    def fields(self) -> dict:
        """The record's stall fields: the line, what it waits on, since when (wall clock); empty when moving."""
        if self.current is None:
            return dict(CLEARED)
        return {"stall": self.current.line(), "stall_what": self.current.what, "stall_since": round(self.since_wall, 3)}

    def _event(self, kind: str, **fields) -> None:
        if self.client is None:
            return
        try:
            log_event(self.client, self.keys, kind, **fields)
        except Exception as e:  # noqa: BLE001 - a report must not end the role (Redis may be what it waits on)
            log.warning("could not log the %s event: %s", kind, e)


def reported(role: str, fields: dict[str, str], now: float) -> dict | None:
    """A role's own stall report from its record's fields (as strings), for `asyncrl status`."""
    line = fields.get("stall") or ""
    if not line:
        return None
    try:
        since = now - float(fields.get("stall_since") or now)
    except ValueError:
        since = 0.0
    reason = line.split(": ", 2)[-1] if line.count(": ") >= 2 else line
    return {"role": role, "what": fields.get("stall_what", ""), "since_s": since, "reason": reason, "source": "self"}
