"""Liveness watchdog: notices when the run stopped moving and says which role is stuck, and on what.

Progress has three pulses, all readable from Redis: a trajectory arrives (the trajectories stream's
last id), the learner steps (`learner.updated_at`), the learner syncs weights (`wsync.announced_at`).
A generator also has its own pulse, its heartbeat (`gen:{id}.updated_at`). When one of them has not
beaten for `run.stall_timeout_s`, `check()` returns a `Stall` naming the role and what it waits on,
derived from the fleet's state (buffer depth, generator states, the learner's version).
Silent hangs are the failure users hate most, so the launcher reports each stall as a `stall` event
and a loud log line, and with `run.on_stall=fail` ends the run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from asyncrl.config import Config
from asyncrl.protocol.keys import Keys, log_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stall:
    role: str  # "learner", "buffer", "generators", "generator:{id}"
    what: str  # "heartbeat", "no_trajectory", "no_step", "no_sync"
    since_s: float  # seconds since the pulse last beat
    reason: str

    def line(self) -> str:
        return f"STALL {self.role}: {self.what} for {self.since_s:.1f}s: {self.reason}"


def _f(value, default: float | None = None) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


_PROC_STATES = {"T": "stopped (SIGSTOP)", "t": "stopped by a tracer", "Z": "a zombie", "D": "in uninterruptible I/O",
                "R": "running", "S": "sleeping"}


def process_state(info: dict) -> str:
    """What the OS says about a generator's process, when it runs on this host ('' otherwise)."""
    import socket

    pid = info.get("pid")
    if not pid or info.get("host") != socket.gethostname():
        return ""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (FileNotFoundError, ValueError):
        return f"; process {pid} on this host no longer exists"
    state = stat.rsplit(")", 1)[1].split()[0]
    return f"; process {pid} on this host is {_PROC_STATES.get(state, state)}"


class Watchdog:
    def __init__(self, client, keys: Keys, cfg: Config, expected_generators: tuple[str, ...] = ()):
        self.client, self.keys, self.cfg = client, keys, cfg
        self.timeout_s = cfg.run.stall_timeout_s
        self.started = time.time()
        self.expected = set(expected_generators)
        self.seen: dict[str, dict] = {}
        self.learner_started_at: float | None = None
        self.sync_done_at = 0.0  # the learner's last `sync` / `sync_failed` event
        self.left: set[str] = set()
        self.ready_at: float | None = None  # first time a generator held a policy version
        self.first_traj_at: float | None = None
        self.reported: set[tuple[str, str]] = set()
        self._last_event_id = b"0-0"

    # ---- reading the fleet ---------------------------------------------------------------------

    def _read(self, now: float) -> dict:
        c, k = self.client, self.keys
        for entry_id, fields in c.xrange(k.events, min=f"({self._last_event_id.decode()}", count=1000):
            self._last_event_id = entry_id
            kind, gid = fields.get(b"kind"), fields.get(b"id", b"").decode()
            if kind == b"generator_leave":
                self.left.add(gid)
            elif kind == b"generator_join":
                self.left.discard(gid)
            elif kind in (b"sync", b"sync_failed") and not gid:  # the learner's, not a generator's
                self.sync_done_at = _f(fields.get(b"t"), time.time())
            elif kind == b"learner_start":
                self.learner_started_at = _f(fields.get(b"t"), time.time())
        import msgspec

        from asyncrl.protocol.fleet import read_fleet

        # The judging below works on field dicts (`seen` keeps those of generators gone since).
        live = {gid: msgspec.structs.asdict(hb) for gid, hb in read_fleet(c, k).items()}
        self.seen.update(live)
        if self.ready_at is None and any(info["version"] >= 0 for info in live.values()):
            self.ready_at = now
        last_traj = None
        try:
            last_id = c.xinfo_stream(k.trajectories)["last-generated-id"]
            ms = int((last_id.decode() if isinstance(last_id, bytes) else last_id).split("-")[0])
            last_traj = ms / 1000.0 if ms else None
        except Exception as e:  # no stream yet
            if "no such key" not in str(e).lower():
                raise
        if last_traj is not None and self.first_traj_at is None:
            self.first_traj_at = last_traj
        learner = {a.decode(): b.decode() for a, b in c.hgetall(k.learner).items()}
        last_sync, sync_version = None, None
        if (frame := c.get(k.wsync)) is not None:
            from asyncrl.protocol import schema

            ann = schema.decode(frame, schema.WeightAnnouncement)
            last_sync, sync_version = ann.announced_at, ann.version
        from asyncrl.observe.metrics import oldest_undelivered_age_s
        from asyncrl.protocol.store import group_lag

        depth = 0
        try:
            depth = group_lag(c, k.trajectories, "learner")
        except Exception as e:  # no stream yet
            if "no such key" not in str(e).lower():
                raise
        buffer_at = _f(c.hget(k.metrics, "buffer:updated_at"))
        members: list[str] = []
        if (frame := c.get(k.wgroup)) is not None:
            from asyncrl.protocol import schema

            members = schema.decode(frame, schema.GroupEpoch).members
        return {"live": live, "last_traj": last_traj, "learner": learner, "last_sync": last_sync,
                "sync_version": sync_version, "members": members, "depth": depth, "buffer_at": buffer_at,
                "version": int(_f(c.get(k.version), 0)), "oldest_age_s": oldest_undelivered_age_s(c, k)}

    # ---- judging -------------------------------------------------------------------------------

    def evaluate(self, now: float | None = None) -> list[Stall]:
        """Every stall that holds right now (reported or not)."""
        now = now or time.time()
        s = self._read(now)
        timeout = self.timeout_s
        if timeout <= 0:
            return []
        batch = self.cfg.learner.batch_groups
        states = ", ".join(f"{g}={i.get('state', '?')}@v{i.get('version', '?')}"
                           for g, i in sorted(s["live"].items()))
        stalls = self._generator_stalls(s["live"], now, timeout)
        if self.ready_at is not None:
            since = now - max(s["last_traj"] or 0.0, self.ready_at)
            if since > timeout and s["depth"] < batch:
                stalls += self._suspects(s["live"], now, {st.role for st in stalls})
                stalls.append(self._no_trajectory(s, since, states))
        stalls += self._no_step(s, now, timeout, states)
        stalls += self._no_sync(s, now, timeout)
        return stalls

    def _generator_stalls(self, live: dict, now: float, timeout: float) -> list[Stall]:
        """Generators whose heartbeat stopped or never came."""
        stalls = []
        for gid, info in sorted(self.seen.items()):
            if gid in self.left:
                continue
            age = now - (_f(info.get("updated_at"), self.started) or self.started)
            if age > timeout:
                gone = gid not in live
                why = ("its heartbeat key expired without a generator_leave: the process died or is frozen"
                       if gone else f"its heartbeat stopped updating (last state={info.get('state', '?')}, "
                       f"pid={info.get('pid') or '?'}): the process is frozen (SIGSTOP, a debugger) or blocked")
                stalls.append(Stall(f"generator:{gid}", "heartbeat", age, why + process_state(info)))
        for gid in sorted(self.expected - set(self.seen)):
            # Engine start-up (model load, vLLM warm-up) can take minutes: a generous bound before
            # calling a generator that never registered stuck.
            if now - self.started > max(timeout, 300.0):
                stalls.append(Stall(f"generator:{gid}", "heartbeat", now - self.started,
                                    "never registered a heartbeat: it failed to start (see its log)"))
        return stalls

    def _suspects(self, live: dict, now: float, named: set[str]) -> list[Stall]:
        """When no trajectory came for the timeout, the generators to blame before their own heartbeat
        timeout runs out: those whose heartbeat key is gone, or whose process the OS reports stopped,
        a zombie or gone. Without this a run ending on the first stall would name only "generators"."""
        stalls = []
        for gid, info in sorted(self.seen.items()):
            if gid in self.left or f"generator:{gid}" in named:
                continue
            state = process_state(info)
            if gid in live and not any(w in state for w in ("stopped", "zombie", "no longer exists")):
                continue
            age = now - (_f(info.get("updated_at"), self.started) or self.started)
            why = ("its heartbeat key expired without a generator_leave: the process died or is frozen"
                   if gid not in live else "its process is not running: it is frozen or dead")
            stalls.append(Stall(f"generator:{gid}", "heartbeat", age, why + state))
        return stalls

    def _no_step(self, s: dict, now: float, timeout: float, states: str) -> list[Stall]:
        """The learner made no step for the timeout, once data has come: inside a broadcast, with a
        full buffer, or waiting for data."""
        if self.first_traj_at is None or self.learner_started_at is None:
            return []
        batch = self.cfg.learner.batch_groups
        learner_at = _f(s["learner"].get("updated_at"))
        in_sync = s["last_sync"] is not None and s["last_sync"] > max(learner_at or 0.0, self.sync_done_at)
        # Inside a broadcast the clock starts at its announcement, which follows the step's
        # training: a generator frozen before it joined is then named first (its heartbeat is
        # older), not the learner that waits on it.
        since = now - (s["last_sync"] if in_sync else
                       max(learner_at or 0.0, self.first_traj_at, self.learner_started_at))
        if since <= timeout:
            return []
        if in_sync:
            # The announcement precedes the broadcast: a newer one than the last step means
            # rank 0 is inside that broadcast, waiting for every member to receive it.
            why = (f"inside the weight broadcast of version {s['sync_version']} announced "
                   f"{now - s['last_sync']:.0f}s ago, waiting for its members {s['members']} "
                   f"(generators: {states or 'none live'}); it gives up after weights.sync_timeout_s")
        elif s["depth"] >= batch:
            why = (f"{s['depth']} groups wait in the buffer (>= learner.batch_groups {batch}, oldest "
                   f"{s['oldest_age_s']:.0f}s) but no step: the learner is stuck in a step, a sync or dead")
        else:
            why = (f"waiting for data: buffer depth {s['depth']} < learner.batch_groups {batch}; "
                   f"generators: {states or 'none live'}")
        return [Stall("learner", "no_step", since, why)]

    def _no_sync(self, s: dict, now: float, timeout: float) -> list[Stall]:
        """The learner stepped past weights.sync_every versions without a broadcast to a live fleet."""
        step = int(_f(s["learner"].get("step"), 0))
        if not (step > 0 and s["live"] and s["last_sync"] is not None):
            return []
        behind = s["version"] - (s["sync_version"] or 0)
        since = now - s["last_sync"]
        if behind > self.cfg.weights.sync_every and since > timeout:
            return [Stall("learner", "no_sync", since,
                          f"the learner is at version {s['version']} but the last weight broadcast was "
                          f"version {s['sync_version']}: the fleet is not getting new weights")]
        return []

    def _no_trajectory(self, s: dict, since: float, states: str) -> Stall:
        live = s["live"]
        if not live:
            return Stall("generators", "no_trajectory", since, "no live generator: every heartbeat is gone")
        if all(i.get("state") == "waiting_weights" for i in live.values()):
            return Stall("generators", "no_trajectory", since,
                         f"every generator is waiting_weights ({states}): they hold no current policy version "
                         f"and the learner's weight broadcast (learner at version {s['version']}) is not reaching them")
        if s["buffer_at"] is not None and time.time() - s["buffer_at"] > max(10.0, self.timeout_s / 2):
            return Stall("buffer", "no_trajectory", since,
                         f"the buffer has not published metrics for {time.time() - s['buffer_at']:.0f}s: "
                         "ingest and the prompt feed are stuck or dead")
        return Stall("generators", "no_trajectory", since,
                     f"no group arrived although generators are live ({states}): they are frozen, "
                     "or waiting for prompts the buffer does not release")

    def check(self, now: float | None = None) -> list[Stall]:
        """Stalls that are new since the last call; a resolved stall can be reported again later."""
        active = self.evaluate(now)
        ids = {(st.role, st.what) for st in active}
        self.reported &= ids
        new = [st for st in active if (st.role, st.what) not in self.reported]
        self.reported |= {(st.role, st.what) for st in new}
        return new


class LauncherWatchdog:
    """The launcher's use of the watchdog: at most one check a second; events and loud lines."""

    def __init__(self, cfg: Config, keys: Keys, expected_generators: tuple[str, ...]):
        from asyncrl.protocol.keys import connect

        self.cfg = cfg
        # Its own client, retrying for a second only: the supervise loop must not block on a Redis
        # outage (the roles ride those out with their own long retries).
        client = connect(cfg.buffer.redis_url, retry_s=1.0)
        self.watchdog = Watchdog(client, keys, cfg, expected_generators)
        self.client, self.keys = client, keys
        self._next = 0.0
        self._redis_down = False

    def poll(self) -> list[Stall]:
        if time.monotonic() < self._next:
            return []
        self._next = time.monotonic() + 1.0
        import redis

        try:
            stalls = self.watchdog.check()
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
            # Redis down (restarting) is not the run's stall; the roles have their own retries.
            if not self._redis_down:
                log.warning("watchdog: cannot read Redis (%s); retrying every second", e)
            self._redis_down = True
            return []
        if self._redis_down:
            log.info("watchdog: Redis reachable again")
        self._redis_down = False
        for st in stalls:
            log.error("%s", st.line())
            print(f"asyncrl run: {st.line()}", flush=True)
            log_event(self.client, self.keys, "stall", **{k: v if isinstance(v, str) else f"{v:.1f}"
                                                         for k, v in asdict(st).items()})
        return stalls


def launcher_watchdog(cfg: Config, keys: Keys) -> LauncherWatchdog | None:
    if cfg.run.stall_timeout_s <= 0:
        return None
    return LauncherWatchdog(cfg, keys, tuple(f"g{i}" for i in range(cfg.generator.num_generators)))
