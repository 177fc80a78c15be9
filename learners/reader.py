"""Learner rank 0's reader of the trajectories stream: XREADGROUP, the staleness filter, the strategy.

Strategies (`buffer.sampling`):
- `fifo` (default): stream order, each group once.
- `newest`: newest first within the staleness bound. Up to `POOL_BATCHES` batches are read ahead;
  what is passed over ages in the pool and is dropped (acked, counted) once it is too stale.
- `replay`: each group is trained up to `buffer.replay_ratio` (k) times while it is within the
  staleness bound. A batch takes at most ceil(batch / k) fresh groups and fills the rest with
  groups already trained fewer than k times (least used, newest first); fresh groups make up any
  shortfall. A group never appears twice in one batch.

Staleness rule: a group whose oldest token lags the learner by more than algorithm.max_staleness is
never trained on; a fresh one is acked and counted (`dropped_groups` in the `learner` hash, which
gives it back to the buffer's admission budget), a replayed one just leaves the pool. A fresh one
dropped (too stale, or sampled ahead of this learner) wastes no prompt: its group id goes on the
`requeue` list in the same script as the ack, and the buffer releases that prompt again before any
new one (buffers/prompts.py), counted as `requeued_stale` / `requeued_ahead` in the `learner` hash.

Exactly once into the model, on our side of the stream: group ids already handed out are
remembered, so an entry Redis delivers again (after a redis-server restart replayed an AOF from
before our XACK, with appendfsync everysec/no) is acked and skipped instead of trained twice. And a
reply lost to a dropped connection (the retried XREADGROUP moved the entries into our pending list
without our seeing them) is found by re-reading our own pending entries after every Redis outage.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass

import redis

from asyncrl.config import Config
from asyncrl.protocol import retry, schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys, log_event

log = logging.getLogger(__name__)

POOL_BATCHES = 4  # `newest` / `replay`: groups held ahead, in batches
REMEMBER = 200_000  # group / entry ids remembered for redelivery checks


# Acks dropped groups, gives them back to the admission budget and puts the group id of each one this
# call acked on the requeue list (a group with no lease, from older writers, is only dropped: its
# dedupe rests on the `seen:` key alone). Counted by what XACK acked, so a retried call neither
# counts nor requeues twice. ARGV: group, MAXLEN, counter, then (entry id, group id or '') pairs.
REQUEUE_DROPPED = """
local n, q = 0, 0
for i = 4, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    n = n + 1
    if ARGV[i + 1] ~= '' then
      redis.call('RPUSH', KEYS[4], ARGV[i + 1])
      q = q + 1
    end
  end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'dropped_groups', n)
  if q > 0 then redis.call('HINCRBY', KEYS[2], ARGV[3], q) end
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'k', 'version')
end
return {n, q}
"""


def requeue_dropped(client: redis.Redis, keys: Keys, dropped: list, why: str) -> tuple[int, int]:
    """Acks the `dropped` (entry id, group) pairs, never trained, and sends their prompts back to be
    sampled again; `why`: "stale" or "ahead". Returns (acked, requeued)."""
    if not dropped:
        return 0, 0
    from asyncrl.protocol.notify import MAXLEN

    args = [a for e, g in dropped for a in (e, g.group_id if g.lease_id else "")]
    n, q = client.eval(REQUEUE_DROPPED, 4, keys.trajectories, keys.learner, keys.notify, keys.requeue,
                       LEARNER_GROUP, MAXLEN, f"requeued_{why}", *args)
    return int(n), int(q)


@dataclass
class _Entry:
    entry_id: bytes
    group: schema.TrajectoryGroup
    min_version: int
    max_version: int
    uses: int = 0


def _remember(d: OrderedDict, key) -> None:
    d[key] = None
    d.move_to_end(key)
    if len(d) > REMEMBER:
        d.popitem(last=False)


class TrajectoryReader:
    def __init__(self, client: redis.Redis, keys: Keys, cfg: Config, consumer: str = "learner-0",
                 known: list | None = None, quarantine=None):
        """`known`: (entry_id, group) pairs the caller already holds (e.g. recovered after a restart);
        `quarantine` (learners/quarantine.py): where undecodable entries go, else they are acked and logged."""
        self.client = client
        self.quarantine = quarantine
        self.keys = keys
        self.consumer = consumer
        self.strategy = cfg.buffer.sampling
        self.replay_ratio = cfg.buffer.replay_ratio if self.strategy == "replay" else 1
        self.max_staleness = cfg.algorithm.max_staleness
        self.pool_cap = POOL_BATCHES * cfg.learner.batch_groups
        self.block_ms = int(cfg.learner.poll_s * 1000)
        self.pool: list[_Entry] = []  # delivered to us, may still be handed out
        self.handed_entries: OrderedDict = OrderedDict()
        self.handed_groups: OrderedDict = OrderedDict()
        for entry_id, group in known or []:
            _remember(self.handed_entries, entry_id)
            _remember(self.handed_groups, group.group_id)
        self._outages = retry.outages()
        self.num_dropped_stale = 0
        self.num_redelivered = 0
        self.num_replayed = 0
        self.num_replay_expired = 0
        self.num_rescued = 0
        self.num_dropped_ahead = 0  # of num_dropped_stale: sampled by versions this learner has not reached
        self.num_requeued = {"stale": 0, "ahead": 0}  # prompts of dropped groups sent back to be sampled again

    # ---- Redis -----------------------------------------------------------------------------------

    def _fetch(self, count: int, block: bool) -> list[tuple[bytes, dict]]:
        reply = self.client.xreadgroup(LEARNER_GROUP, self.consumer, {self.keys.trajectories: ">"}, count=count,
                                       block=self.block_ms if block else None)
        return reply[0][1] if reply else []

    def _rescan_pending(self) -> list[tuple[bytes, dict]]:
        """Our own pending entries we never saw (a reply lost when Redis went away)."""
        found, start = [], "0"
        while True:
            reply = self.client.xreadgroup(LEARNER_GROUP, self.consumer, {self.keys.trajectories: start}, count=1000)
            entries = reply[0][1] if reply else []
            if not entries:
                break
            found += [(e, f) for e, f in entries if e not in self.handed_entries
                      and all(p.entry_id != e for p in self.pool)]
            start = entries[-1][0]
        if found:
            self.num_rescued += len(found)
            log.warning("found %d delivered-but-unseen trajectory groups after a Redis outage", len(found))
        return found

    def _admit(self, raw: list[tuple[bytes, dict]]) -> None:
        redelivered = []
        for entry_id, fields in raw:
            if self.quarantine is not None:
                # Deleted entries acked, undecodable ones quarantined: the same as on the recovery path.
                group = self.quarantine.entry(entry_id, fields)
                if group is None:
                    continue
            else:
                data = fields.get(b"data") if fields else None
                try:
                    if data is None:
                        raise schema.FrameError("missing", "entry has no data field")
                    group = schema.decode(data, schema.TrajectoryGroup)
                except schema.FrameError as e:  # the buffer validated it; a corrupt entry is skipped, loudly
                    log.error("unreadable trajectory entry %s skipped: %s", entry_id, e)
                    redelivered.append(entry_id)
                    continue
            if group.group_id in self.handed_groups:
                redelivered.append(entry_id)
                continue
            self.pool.append(_Entry(entry_id, group, group.min_version(), group.max_version()))
        if redelivered:
            self.num_redelivered += len(redelivered)
            self.client.xack(self.keys.trajectories, LEARNER_GROUP, *redelivered)
            log.warning("acked %d trajectory entries delivered again (already trained) or unreadable",
                        len(redelivered))

    def _drop_stale(self, version: int) -> int:
        keep, stale, ahead = [], [], []
        for e in self.pool:
            # A token from a version this learner has not reached was sampled by weights it never had (an
            # older run's state, or updates lost with a checkpoint): never trained, so a lag is never negative.
            if e.max_version > version:
                ahead.append((e.entry_id, e.group))
            # Staleness rule: a group whose oldest token lags more than max_staleness is not trained on.
            elif version - e.min_version <= self.max_staleness:
                keep.append(e)
            elif e.uses == 0:
                stale.append((e.entry_id, e.group))
            else:
                self.num_replay_expired += 1
        self.pool = keep
        if not stale and not ahead:
            return 0
        for why, dropped in (("stale", stale), ("ahead", ahead)):
            self.num_requeued[why] += requeue_dropped(self.client, self.keys, dropped, why)[1]
        self.num_dropped_stale += len(stale) + len(ahead)
        if ahead:
            self.num_dropped_ahead += len(ahead)
            log.warning("dropped %d trajectory groups sampled by versions ahead of this learner's %d (not trained; "
                        "they come from weights this learner never had); their prompts are sampled again",
                        len(ahead), version)
        log_event(self.client, self.keys, "drop_stale", num=len(stale) + len(ahead), version=version,
                  ahead=len(ahead))
        return len(stale) + len(ahead)

    # ---- strategy --------------------------------------------------------------------------------

    def _select(self, need: int, exclude: set[str]) -> list[_Entry]:
        cands = [e for e in self.pool if e.group.group_id not in exclude and e.uses < self.replay_ratio]
        fresh = [e for e in cands if e.uses == 0]
        if self.strategy == "fifo":
            return fresh[:need]
        if self.strategy == "newest":
            return sorted(fresh, key=lambda e: (e.min_version, e.group.created_at), reverse=True)[:need]
        quota = math.ceil(need / self.replay_ratio)
        chosen = fresh[:quota]
        reused = sorted((e for e in cands if e.uses > 0), key=lambda e: (e.uses, -e.min_version, -e.group.created_at))
        chosen += reused[:need - len(chosen)]
        chosen += fresh[quota:quota + need - len(chosen)]
        return chosen

    def read(self, need: int, version: int, in_hand: list | None = None) -> tuple[list, int]:
        """Up to `need` (entry_id, group) pairs to train on at learner `version`, and how many were
        dropped as stale. Blocks up to learner.poll_s only when nothing is there to hand out.

        `in_hand`: pairs the caller holds and has not trained yet (kept out of the selection)."""
        exclude = {g.group_id for _, g in in_hand or []}
        raw = []
        if retry.outages() != self._outages:
            self._outages = retry.outages()
            raw += self._rescan_pending()
        self._admit(raw)
        dropped = self._drop_stale(version)
        ready = len(self._select(need, exclude))
        want = need if self.strategy == "fifo" else max(need, self.pool_cap - len(self.pool))
        if self.strategy == "replay":
            want = max(math.ceil(need / self.replay_ratio), self.pool_cap - len(self.pool))
        if want > 0 and (self.strategy != "fifo" or ready < need):
            self._admit(self._fetch(want, block=ready < need))
            dropped += self._drop_stale(version)
        chosen = self._select(need, exclude)
        for e in chosen:
            if e.uses > 0:
                self.num_replayed += 1
            e.uses += 1
            _remember(self.handed_entries, e.entry_id)
            _remember(self.handed_groups, e.group.group_id)
        self.pool = [e for e in self.pool if e.uses < self.replay_ratio]
        return [(e.entry_id, e.group) for e in chosen], dropped

    def stats(self) -> dict[str, int]:
        return {"dropped_stale": self.num_dropped_stale, "redelivered": self.num_redelivered,
                "replayed": self.num_replayed, "replay_expired": self.num_replay_expired,
                "rescued": self.num_rescued, "dropped_ahead": self.num_dropped_ahead, "pool": len(self.pool),
                "requeued_stale": self.num_requeued["stale"], "requeued_ahead": self.num_requeued["ahead"]}
