"""The buffer's gauges: how many groups wait undelivered (backpressure at `buffer.capacity`), the
counters and rates published as `buffer:*` in the run's metrics hash, and the buffer's own stall
check (asyncrl/observe/selfwatch.py), published with them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.observe.selfwatch import SelfWatch
from asyncrl.protocol.fleet import read_fleet
from asyncrl.protocol.keys import Keys
from asyncrl.protocol.store import LEARNER_GROUP, PROMPT_GROUP, group_lag, oldest_unacked_ms, trim_trained

log = logging.getLogger("buffers.service")  # the buffer's records keep the one name they have always had

RCVHWM = 256  # frames queued in our PULL socket before ZeroMQ stops taking more from generators
TRIM_EVERY_S = 30.0  # trained groups past `buffer.retain_trained_s` leave the stream this often


class Counters(dict):
    """The buffer's counters by name (published as buffer:{name}; they survive buffer restarts)."""

    def count(self, name: str, k: int = 1) -> None:
        self[name] = self.get(name, 0) + k


class Gauges:
    """The buffer's gauges over its Redis `client`; `instance`: the buffer's instance id."""

    def __init__(self, cfg: Config, client, keys: Keys, counters: Counters, instance: str):
        self.cfg, self.client, self.keys, self.counters, self.instance = cfg, client, keys, counters, instance
        self.exporter = None  # /metrics (asyncrl/observe/exporter.py), once the buffer has started it
        self._last_rates = (time.monotonic(), 0, 0)
        self._depth, self._depth_at = 0, 0.0  # undelivered groups, when last measured
        self.full = False
        self._full_since = 0.0
        # Its own stall check, published with the metrics: no launcher needed.
        self.watch = SelfWatch("buffer", cfg.run.stall_timeout_s, client, keys)
        self._stored = 0  # groups stored or deduped when last looked: the buffer's progress
        self._trimmed_at = 0.0

    def depth(self) -> int:
        return group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)

    def added(self, num: int) -> None:
        """`num` groups were just appended: undelivered until the learner reads them."""
        self._depth += num

    def room(self) -> int:
        """Groups that may still be appended before the trajectory stream holds `capacity` undelivered."""
        now = time.monotonic()
        capacity = self.cfg.buffer.capacity
        # Re-measure often when close to full (the learner may have read meanwhile), rarely otherwise.
        stale_after = 0.05 if self._depth >= capacity - RCVHWM else 0.5
        if now - self._depth_at > stale_after:
            self._depth, self._depth_at = self.depth(), now
        return capacity - self._depth

    def update_full(self, room: int) -> None:
        # Backpressure: at capacity we stop pulling; ZMQ high-water marks then hold the generators'
        # sends (and their outboxes stop leasing), so nothing is dropped anywhere.
        full = room <= 0
        if full and not self.full:
            log.warning("trajectory buffer full (%d undelivered >= buffer.capacity %d): ingest paused",
                        self._depth, self.cfg.buffer.capacity)
            self.counters.count("full_pauses")
            self._full_since = time.monotonic()
        elif self.full and not full:
            paused = time.monotonic() - self._full_since
            self.counters.count("full_ms", int(paused * 1000))
            log.info("trajectory buffer has room again after %.1fs: ingest resumed", paused)
        self.full = full

    def publish(self) -> None:
        client, keys, counters = self.client, self.keys, self.counters
        now = time.monotonic()
        t0, groups0, bytes0 = self._last_rates
        dt = max(now - t0, 1e-6)
        groups, nbytes = counters.get("groups", 0), counters.get("bytes", 0)
        self._last_rates = (now, groups, nbytes)
        depth = self.depth()
        oldest_ms = oldest_unacked_ms(client, keys.trajectories, LEARNER_GROUP)
        server_s, server_us = client.time()
        if self.cfg.buffer.retain_trained_s > 0 and now - self._trimmed_at > TRIM_EVERY_S:
            self._trimmed_at = now
            self.trim(server_s + server_us / 1e6)
        oldest_age = 0.0 if oldest_ms is None else max(server_s + server_us / 1e6 - oldest_ms / 1000, 0.0)
        fields = {**counters, "depth": depth, "capacity": self.cfg.buffer.capacity, "full": int(self.full),
                  "groups_per_s": (groups - groups0) / dt, "bytes_per_s": (nbytes - bytes0) / dt,
                  "oldest_age_s": oldest_age, "stream_len": client.xlen(keys.trajectories),
                  "instance": self.instance, "updated_at": time.time()}
        client.hset(keys.metrics, mapping={f"buffer:{k}": v for k, v in {**fields, **self.watch.fields()}.items()})
        if self.exporter is not None:
            self.exporter.update(fields)

    def trim(self, server_now_s: float) -> None:
        """Trained groups, and prompts whose lease is over (stored, reclaimed, handed back), older than
        buffer.retain_trained_s leave their streams; undelivered and pending entries stay. Without the
        prompts' trim every prompt ever released stayed in Redis (a few hundred bytes each)."""
        cutoff_ms = int((server_now_s - self.cfg.buffer.retain_trained_s) * 1000)
        self.counters.count("trimmed", trim_trained(self.client, self.keys.trajectories, LEARNER_GROUP, cutoff_ms))
        self.counters.count("prompts_trimmed", trim_trained(self.client, self.keys.prompts, PROMPT_GROUP, cutoff_ms))

    def watch_progress(self, wait_reason: Callable[[], str]) -> None:
        """Progress is a group stored (or a re-sent one deduped); the clock starts once a generator
        holds a version, before which nothing can arrive. `wait_reason`: what a stall waits on."""
        stored = self.counters.get("groups", 0) + self.counters.get("dedupes", 0)
        if stored != self._stored:
            self._stored = stored
            self.watch.progress()
            return
        if not self.watch.moved and not any(hb.version >= 0 for hb in read_fleet(self.client, self.keys).values()):
            self.watch.hold()  # nobody can generate yet: not waiting on anyone
            return
        self.watch.check("no_trajectory", wait_reason)
