"""The buffer's prompt side: prompt groups released to the `prompts` stream under the admission rule
(staleness bounded by construction), and prompts whose lease expired (their generator died)
released again after `buffer.lease_timeout_s`, and prompts whose group the learner dropped unused
(too stale, or sampled ahead of a resumed learner) released again before any new one.
"""

from __future__ import annotations

import logging
import time

from asyncrl.config import Config
from asyncrl.modes import admission_staleness
from asyncrl.protocol import members, schema, store
from asyncrl.protocol.fleet import admitted, read_fleet
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, log_event
from asyncrl.protocol.notify import publish
from asyncrl.protocol.store import group_lag
from asyncrl.tasks.base import PromptRecord, iter_epochs
from buffers.gauges import Counters

log = logging.getLogger("buffers.service")  # the buffer's records keep the one name they have always had

RECLAIMER = "buffer-reclaim"
RELEASE_BACKLOG_S = 0.05  # how often a release held back by buffer.prompt_backlog is tried again

# Re-release of the requeue list's head (group ids the learner dropped unused, learners/reader.py) as
# a compare-and-set on the cursor's `released`, like a new release: a retry, or a second buffer, finds
# it moved or the head changed and adds nothing. Each prompt counts against the admission budget as a
# release. Its old `seen:` key goes: the group stored under that id was never trained, and a late copy
# of it is refused by its lease, acked when it was stored. ARGV: released, k, k ids, k frames ('' for a
# prompt not in this run's data: popped, not released); KEYS: cursor, prompts, requeue, k seen keys.
RELEASE_REQUEUED = """
if tonumber(redis.call('HGET', KEYS[1], 'released') or '0') ~= tonumber(ARGV[1]) then return -1 end
local k = tonumber(ARGV[2])
local head = redis.call('LRANGE', KEYS[3], 0, k - 1)
if #head ~= k then return -1 end
for i = 1, k do
  if head[i] ~= ARGV[2 + i] then return -1 end
end
local n = 0
for i = 1, k do
  local frame = ARGV[2 + k + i]
  if frame ~= '' then
    redis.call('XADD', KEYS[2], '*', 'data', frame)
    redis.call('DEL', KEYS[3 + i])
    n = n + 1
  end
end
redis.call('LTRIM', KEYS[3], k, -1)
redis.call('HSET', KEYS[1], 'released', tonumber(ARGV[1]) + n)
return n
"""


def admission_budget(version: int, max_staleness: int, groups_per_step: int, dropped_groups: int) -> int:
    """How many prompt groups may have been released in total at learner `version`.

    The AReaL rule: a group released now is trained at the latest `max_staleness` versions later,
    because no more than (max_staleness + 1) steps' worth of groups is ever outstanding. Groups the
    learner dropped (stale, or zero-variance) are added back so the pipe never starves.
    """
    return (version + max_staleness + 1) * groups_per_step + dropped_groups


def admission_version(learner_version: int, fleet: dict, admit) -> int:
    """The version the admission budget counts from: the learner's, or the lowest held by a generator
    that takes prompts, whichever is lower.

    A prompt released now starts on the weights its generator holds, not the learner's: released at
    learner version v while a push of v is still on its way, it would start on v-1 and be two
    versions behind by the time the learner reaches it, and be dropped as stale. Counting from the
    generators' version releases the next batch's prompts only once the weights they start on have
    landed. Generators holding no version (joining, or after a failed sync), draining ones and ones
    without a valid run token are left out; with none left the learner's version counts."""
    held = [hb.version for hb in fleet.values() if hb.version >= 0 and hb.state != "draining" and admit(hb)]
    return min([learner_version, *held])


class PromptFeed:
    """The prompt side over the run's Redis `client`: `rows`, the task's training rows in release order."""

    def __init__(self, cfg: Config, client, keys: Keys, rows: list[PromptRecord], counters: Counters):
        self.cfg, self.client, self.keys, self.rows, self.counters = cfg, client, keys, rows, counters
        self.backlog_bound = False  # the last release was held back by buffer.prompt_backlog
        self._row_of = {}
        for row in rows:
            self._row_of.setdefault(row.prompt_id, row)

    def release(self) -> int:
        """Releases prompts up to the admission budget and the backlog cap; returns how many."""
        cfg, client, keys = self.cfg, self.client, self.keys
        version = int(client.get(keys.version) or 0)
        dropped, bound = client.hmget(keys.learner, "dropped_groups", "staleness_bound")
        cursor = {k.decode(): int(v) for k, v in client.hgetall(keys.cursor).items()}
        budget = self._budget(version, int(dropped or 0), cursor["released"], bound)
        backlog = group_lag(client, keys.prompts, PROMPT_GROUP)
        num = min(budget - cursor["released"], cfg.buffer.prompt_backlog - backlog)
        self.backlog_bound = cfg.buffer.prompt_backlog - backlog < budget - cursor["released"]
        if num <= 0:
            return 0
        requeued = self._release_requeued(num, cursor["released"])
        if requeued < 0:
            log.warning("prompt cursor moved under us (another buffer instance?): release skipped")
            return 0
        num, cursor["released"] = num - requeued, cursor["released"] + requeued
        if num <= 0:
            publish(client, keys, "prompts")
            return requeued
        it = iter_epochs(self.rows, cfg.run.seed, cursor["epoch"], cursor["index"])
        now = time.time()
        epoch, index = cursor["epoch"], cursor["index"]
        frames = []
        for _ in range(num):
            epoch, index, row = next(it)
            task = schema.PromptTask(schema_version=schema.SCHEMA_VERSION, group_id=f"{row.prompt_id}@e{epoch}",
                                     prompt_id=row.prompt_id, prompt=row.prompt, answer=row.answer,
                                     released_at=now)
            frames.append(schema.encode(task))
        index += 1
        if index >= len(self.rows):
            epoch, index = epoch + 1, 0
        # The cursor moves in the same script as the XADDs, and only if nobody moved it meanwhile:
        # a crash releases all of them or none, a retried call or a second buffer none twice.
        if not store.release_prompts(client, keys, cursor["released"], epoch, index, frames):
            log.warning("prompt cursor moved under us (another buffer instance?): release skipped")
            return 0
        publish(client, keys, "prompts")  # sync-mode generators read the prompt stream without blocking
        return requeued + num

    def _release_requeued(self, num: int, released: int) -> int:
        """Releases up to `num` prompts from the requeue list's head (same group id, so the ingest's
        check that the id was released holds); returns how many, -1 if the cursor or the list moved."""
        client, keys = self.client, self.keys
        ids = [i.decode() for i in client.lrange(keys.requeue, 0, num - 1)]
        if not ids:
            return 0
        now, frames = time.time(), []
        for gid in ids:
            parts = schema.split_group_id(gid)
            row = self._row_of.get(parts[0]) if parts else None
            if row is None:
                log.error("requeued group %r names no prompt of this run's data: not released again", gid)
                frames.append(b"")
                continue
            frames.append(schema.encode(schema.PromptTask(
                schema_version=schema.SCHEMA_VERSION, group_id=gid, prompt_id=row.prompt_id, prompt=row.prompt,
                answer=row.answer, released_at=now)))
        n = int(client.eval(RELEASE_REQUEUED, 3 + len(ids), keys.cursor, keys.prompts, keys.requeue,
                            *[keys.seen(g) for g in ids], released, len(ids), *ids, *frames))
        if n > 0:
            self.counters.count("requeues", n)
            log_event(client, keys, "requeue", num=n)
        return n

    def _budget(self, version: int, dropped: int, released: int, bound: bytes | None = None) -> int:
        """The admission budget at learner `version` with `dropped` groups dropped by the learner,
        `released` prompts released so far and the learner's `bound` in force (max_staleness=auto)."""
        cfg = self.cfg
        # run.mode=sync: staleness 0, exactly learner.batch_groups prompts per version (asyncrl/modes.py).
        staleness, per_step = admission_staleness(cfg, bound), cfg.learner.batch_groups
        budget = admission_budget(version, staleness, per_step, dropped)
        # The fleet can only lower the budget: read it only when the learner's would release some.
        # (sync: generators start a group only on the learner's version.)
        if cfg.run.mode != "sync" and budget > released:
            version = admission_version(version, read_fleet(self.client, self.keys), lambda hb: admitted(cfg, hb)[0])
            budget = admission_budget(version, staleness, per_step, dropped)
        return budget

    def reclaim(self) -> int:
        """Re-releases prompts whose lease expired (their generator died); same group_id, so dedupe holds."""
        min_idle_ms = int(self.cfg.buffer.lease_timeout_s * 1000)
        # Members gone past their leases are forgotten here, so status lists each dead one until then.
        if forgotten := members.prune(self.client, self.keys, self.cfg.buffer.lease_timeout_s):
            log.info("forgot generators %s: heartbeat gone and no lease held", ", ".join(forgotten))
        claimed = self.client.xautoclaim(self.keys.prompts, PROMPT_GROUP, RECLAIMER, min_idle_ms,
                                         start_id="0-0", count=100, justid=True)
        if not claimed:
            return 0
        num = store.requeue_prompts(self.client, self.keys, claimed)
        self.counters.count("reclaims", num)
        log_event(self.client, self.keys, "reclaim", num=num)
        log.warning("reclaimed %d prompts whose lease expired", num)
        return num

    def wait_reason(self) -> str:
        """What the buffer waits on when no group arrives: the learner (the admission budget is spent) or
        the generators (asyncrl/observe/selfwatch.py reports it)."""
        client, keys = self.client, self.keys
        version = int(client.get(keys.version) or 0)
        dropped, bound = client.hmget(keys.learner, "dropped_groups", "staleness_bound")
        released = int(client.hget(keys.cursor, "released") or 0)
        budget = admission_budget(version, admission_staleness(self.cfg, bound), self.cfg.learner.batch_groups,
                                  int(dropped or 0))
        backlog = group_lag(client, keys.prompts, PROMPT_GROUP)
        leased = int(client.xpending(keys.prompts, PROMPT_GROUP)["pending"])
        fleet = read_fleet(client, keys)
        states = ", ".join(f"{g}={hb.state}@v{hb.version}" for g, hb in sorted(fleet.items())) or "none live"
        if backlog == 0 and leased == 0 and released >= budget:
            return (f"waiting for the learner: the admission budget is spent ({released} prompts released of "
                    f"{budget} at learner version {version}) and no prompt is out; generators: {states}")
        return (f"waiting for generators: no group arrived although {leased} prompts are leased and {backlog} "
                f"wait to be leased ({released} released, learner at version {version}); generators: {states}")
