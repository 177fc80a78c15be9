"""Learner rank 0's feed: the run's Redis claimed at start, the groups delivered before a restart,
batches read from the trajectories stream (learners/reader.py), screened (learners/quarantine.py)
and thinned by dynamic sampling, and the acks of the trajectories a durable update used.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from asyncrl.config import Config
from asyncrl.protocol import identity, sampling, schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys, connect, log_event
from asyncrl.protocol.store import ack_dropped, ensure_groups, group_lag
from learners.fleet import Fleet
from learners.quarantine import Quarantine
from learners.reader import TrajectoryReader, requeue_dropped

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had


def open_run(cfg: Config) -> tuple:
    """(client, keys) of the run's Redis, once this learner has claimed the run, made sure the
    consumer groups exist, cleared an old stop, and checked the fleet's sampling settings."""
    keys = Keys(cfg.run.name)
    client = connect(cfg.buffer.redis_url)
    identity.claim(client, keys, cfg, "learner")  # a finished or foreign run of this name is refused
    ensure_groups(client, keys)  # idempotent; the learner may start before the buffer
    client.delete(keys.stop, keys.stop_request)
    # Refuse to start next to generators that sample differently; publish ours for late ones.
    sampling.check_fleet(client, keys, cfg.generator)
    sampling.publish(client, keys, cfg.generator)
    return client, keys


def ack_checkpointed(client, keys: Keys, checkpoint: Path) -> int:
    """Acks the trajectories whose update the resumed `checkpoint` already holds (its meta.json's
    `acked_entries`); returns how many were still unacked. The learner acks them right after the
    checkpoint is complete; one that died in between (or while Redis was away for that ack) left
    them pending, and the recovery path would train them a second time on top of the checkpoint
    that holds them. Acking an entry twice is a no-op, so this is safe on every resume."""
    entries = json.loads((Path(checkpoint) / "meta.json").read_text()).get("acked_entries", [])
    num = int(client.xack(keys.trajectories, LEARNER_GROUP, *entries)) if entries else 0
    if num:
        log.warning("%d trajectory groups of checkpoint %s were never acked (the learner stopped between the "
                    "checkpoint and its ack): acked now, not trained again", num, checkpoint)
        log_event(client, keys, "ack_checkpointed", num=num, checkpoint=str(checkpoint))
    return num


class Feed:
    """The groups in hand and what became of the others; built once rank 0's Redis is set up, it
    first takes back what was delivered before a restart."""

    def __init__(self, cfg: Config, client, keys: Keys, fleet: Fleet, vocab_size: int, version: int):
        self.cfg, self.client, self.keys, self.fleet = cfg, client, keys, fleet
        # The screen every group passes before a batch; `vocab_size`: rows of the embedding the
        # log-prob gather indexes.
        self.quarantine = Quarantine(client, keys, schema.RunLimits.from_config(cfg, vocab_size))
        self.pending: list = []  # (entry id, group), in the order they are trained
        self.unacked: list = []  # entries of trained groups, acked once their update is durable
        self.dropped_stale = 0
        self.dropped_zero_var = 0
        self.requeued_ahead = 0  # prompts of groups dropped on recovery, sent back (the reader counts its own)
        self.idle_s = 0.0
        self.data_wait_s = 0.0  # this step's: waiting for data
        self.last_fleet_check = 0.0
        self.last_stop_check = 0.0
        self._recover_pending(version)
        self.reader = TrajectoryReader(client, keys, cfg, known=self.pending, quarantine=self.quarantine)

    def _recover_pending(self, version: int) -> None:
        """After a restart, trajectories delivered to us but never acked (their update was not in a
        durable checkpoint) come first, in their original order. They are read and screened exactly
        as a fresh read is (learners/quarantine.py): a poison group left pending by a crash is moved
        aside, not trained first and crashed on again; an entry deleted from the stream is acked; a
        group sampled by versions ahead of this learner's is dropped like the reader drops it. The
        log line says how many of each."""
        quarantine = self.quarantine
        reply = self.client.xreadgroup(LEARNER_GROUP, "learner-0", {self.keys.trajectories: "0"}, count=100_000)
        entries = reply[0][1] if reply else []
        if not entries:
            return
        moved0, deleted0 = quarantine.num, quarantine.num_deleted
        read = [(entry_id, g) for entry_id, fields in entries if (g := quarantine.entry(entry_id, fields)) is not None]
        screened = quarantine.screen(read)
        keep = [(e, g) for e, g in screened if g.max_version() <= version]
        ahead = [(e, g) for e, g in screened if g.max_version() > version]
        if ahead:  # sampled by weights this learner no longer has: never trained, their prompts sampled again
            self.requeued_ahead += requeue_dropped(self.client, self.keys, ahead, "ahead")[1]
            self.dropped_stale += len(ahead)
        self.pending.extend(keep)
        quarantined, deleted = quarantine.num - moved0, quarantine.num_deleted - deleted0
        log.warning("%d trajectory groups were delivered before the restart but never acked: re-training %d, "
                    "quarantined %d (see %s), %d deleted from the stream, %d dropped as sampled by versions "
                    "ahead of this learner's %d (their prompts sampled again)", len(entries), len(keep), quarantined, self.keys.quarantine,
                    deleted, len(ahead), version)
        log_event(self.client, self.keys, "redeliver", num=len(keep), quarantined=quarantined, deleted=deleted,
                  ahead=len(ahead))

    def take(self, need: int, version: int) -> list | None:
        """`need` (entry id, group) pairs, topped up from the stream when fewer are in hand; None
        while there are not enough yet."""
        if len(self.pending) < need:
            self._read_groups(need - len(self.pending), version)
        if len(self.pending) < need:
            return None
        batch, self.pending = self.pending[:need], self.pending[need:]
        return batch

    def _read_groups(self, need: int, version: int) -> None:
        """Tops up self.pending through the reader (learners/reader.py: XREADGROUP, the staleness
        filter, buffer.sampling); groups recovered after a restart are already in self.pending."""
        got, dropped = self.reader.read(need, version, in_hand=self.pending)
        # Sampling settings, token ids, lengths and ids against the run: a group that fails is
        # quarantined, never trained and never fatal (raising here would crash every restart).
        got = self.quarantine.screen(got)
        if self.cfg.algorithm.dynamic_sampling:
            # DAPO dynamic sampling: a group whose rewards are all equal has zero advantage everywhere
            # and only dilutes the batch; drop it (acked, counted, given back to the admission budget).
            flat = [(e, g) for e, g in got if len({s.reward for s in g.samples}) == 1]
            if flat:
                ack_dropped(self.client, self.keys, [e for e, _ in flat])
                self.dropped_zero_var += len(flat)
                got = [(e, g) for e, g in got if len({s.reward for s in g.samples}) > 1]
        self.pending.extend(got)
        self.dropped_stale += dropped

    def stop_requested(self) -> bool:
        """`stop_request` (the Redis key, set by hand, a script or a test): finish like at max_steps, cleanly."""
        if time.monotonic() - self.last_stop_check < 1.0:
            return False
        self.last_stop_check = time.monotonic()
        return bool(self.client.exists(self.keys.stop_request))

    def fleet_check_due(self) -> bool:
        """At most one fleet check a second while waiting for data."""
        if time.monotonic() - self.last_fleet_check <= 1.0:
            return False
        self.last_fleet_check = time.monotonic()
        return True

    def data_wait_reason(self, need: int, version: int) -> str:
        """What a learner waiting for data waits on, for its stall report."""
        fleet = self.fleet.read_fleet()
        states = ", ".join(f"{g}={hb.state}@v{hb.version}" for g, hb in sorted(fleet.items())) or "none live"
        depth = group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)
        at = self.client.hget(self.keys.metrics, "buffer:updated_at")
        buffer = f"the buffer published {time.time() - float(at):.0f}s ago" if at else "no buffer has published"
        return (f"waiting for data: {len(self.pending)} of learner.batch_groups {need} groups in hand, {depth} "
                f"undelivered in the stream, learner at version {version}; {buffer}; generators: {states}")

    def ack(self) -> None:
        """Acks the trajectories of every update made durable since the last ack."""
        if self.unacked:
            self.client.xack(self.keys.trajectories, LEARNER_GROUP, *self.unacked)
            self.unacked = []
