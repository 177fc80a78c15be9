"""Redis operations shared by the roles: stream set-up, atomic dedupe + append, stream depth, trimming."""

from __future__ import annotations

import redis

from asyncrl.protocol.keys import LEARNER_GROUP, PROMPT_GROUP, Keys

# Dedupe and append in one atomic step, so a crash between the two can neither lose a group
# (marked seen, never appended) nor let a late duplicate in. A group that names its prompt's lease
# (ARGV[4]) is stored only if that lease is still pending, and the same step acks it: every prompt
# entry is acked once, either here (its group stored) or by the reclaimer (re-released as a new entry),
# so no copy of a stored group can be stored again, however late it comes. The `seen:` key then
# only tells the generator that its group is in (generators/outbox.py) and can expire (seen_ttl_s).
# Replies: 1 stored, 0 duplicate (seen), -1 lease gone (refused).
DEDUPE_APPEND = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if ARGV[4] ~= '' and redis.call('XACK', KEYS[3], ARGV[3], ARGV[4]) == 0 then return -1 end
redis.call('SET', KEYS[1], '1', 'EX', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'data', ARGV[1])
return 1
"""

# The dedupe window of a group that carries no lease (older writers): exactly-once for them rests on
# the `seen:` key alone, so it is kept long.
SEEN_TTL_S = 7 * 24 * 3600


def seen_ttl_s(lease_timeout_s: float, redis_retry_s: float) -> int:
    """How long a leased group's `seen:` key lives: while its generator may still be waiting to see it.
    A live generator looks every 0.1 s; one cut off from Redis retries for up to buffer.redis_retry_s;
    one that holds a group renews its lease every lease_timeout_s / 3 and, when the lease is gone
    (stored, or reclaimed), drops the group anyway. Exactly-once does not depend on it (the lease does)."""
    return int(lease_timeout_s + redis_retry_s) + 1

# Every write below may run twice: a retried command (asyncrl/protocol/retry.py) can already have executed
# before its connection broke. So each is idempotent, and each is one script, so a crash (or a
# redis-server restart, which replays a prefix of its AOF) sees all of it or none of it.

# Prompt release as compare-and-set on the cursor: a retry, or a second buffer instance racing
# this one, finds `released` moved and adds nothing.
RELEASE_PROMPTS = """
if tonumber(redis.call('HGET', KEYS[1], 'released') or '0') ~= tonumber(ARGV[1]) then
  return 0
end
for i = 5, #ARGV do
  redis.call('XADD', KEYS[2], '*', 'data', ARGV[i])
end
redis.call('HSET', KEYS[1], 'epoch', ARGV[2], 'index', ARGV[3], 'released', ARGV[4])
return 1
"""

# Re-queue of expired leases: only an entry this call acks is copied to the stream's tail, so a
# retry (or a generator's late XACK) cannot requeue it twice.
RECLAIM_REQUEUE = """
local n = 0
for i = 2, #ARGV do
  local id = ARGV[i]
  if redis.call('XACK', KEYS[1], ARGV[1], id) == 1 then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    if #e > 0 then
      redis.call('XADD', KEYS[1], '*', unpack(e[1][2]))
      n = n + 1
    end
    redis.call('XDEL', KEYS[1], id)
  end
end
return n
"""

# Acks groups dropped as stale and gives them back to the admission budget, counted by what XACK
# actually acked (so a retry does not count twice); wakes the buffer (asyncrl/protocol/notify.py) when it did.
ACK_DROPPED = """
local n = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 3))
if n > 0 then
  redis.call('HINCRBY', KEYS[2], 'dropped_groups', n)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[2], '*', 'k', 'version')
end
return n
"""


def ensure_groups(client: redis.Redis, keys: Keys) -> None:
    for stream, group in ((keys.prompts, PROMPT_GROUP), (keys.trajectories, LEARNER_GROUP)):
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


# The group's undelivered entries: Redis >= 7 reports `lag` (entries added - the group's entries
# read). A redis-server restarted from its AOF came back with entries-read behind (7.0.15, after a
# SIGKILL: lag 1394 with every entry delivered), and the buffer, reading that as its prompt backlog,
# released no prompt again: the run stood still. So when the group has been delivered the stream's
# last entry the lag is 0, and a counter that says otherwise is set right in the same script
# (atomic: no entry can be added or read in between). -1: Redis reports no lag.
GROUP_LAG = """
local last, added
local s = redis.call('XINFO', 'STREAM', KEYS[1])
for i = 1, #s, 2 do
  if s[i] == 'last-generated-id' then last = s[i + 1] elseif s[i] == 'entries-added' then added = s[i + 1] end
end
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[1] then
    if f['last-delivered-id'] == last then
      if f['lag'] ~= 0 and added ~= nil then
        redis.call('XGROUP', 'SETID', KEYS[1], ARGV[1], last, 'ENTRIESREAD', added)
      end
      return 0
    end
    if not f['lag'] then return -1 end
    return f['lag']
  end
end
return 0
"""


def group_lag(client: redis.Redis, stream: str, group: str) -> int:
    """Entries in `stream` not yet delivered to `group` (see GROUP_LAG)."""
    try:
        lag = int(client.eval(GROUP_LAG, 1, stream, group))
    except redis.ResponseError as e:
        if "no such key" in str(e).lower():  # no stream yet: nothing to deliver
            return 0
        raise
    if lag < 0:  # lag is unknown after some deletions; fall back to an upper bound
        return int(client.xlen(stream))
    return lag


# Trims trained entries: those older than ARGV[1] (an id, "ms-0"), never one the group has not
# been delivered or has not acked. MINID is the smallest of the age cutoff, the oldest pending id
# and the last delivered id (kept itself: harmless). Atomic, so nothing is delivered in between.
TRIM_TRAINED = """
local function less(a, b)
  local am, as = string.match(a, '(%d+)-(%d+)')
  local bm, bs = string.match(b, '(%d+)-(%d+)')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as < bs)
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local cut = ARGV[1]
local delivered = nil
for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local f = {}
  for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
  if f['name'] == ARGV[2] then delivered = f['last-delivered-id'] end
end
if delivered == nil then return 0 end
if less(delivered, cut) then cut = delivered end
local pending = redis.call('XPENDING', KEYS[1], ARGV[2])
if pending[2] and less(pending[2], cut) then cut = pending[2] end
return redis.call('XTRIM', KEYS[1], 'MINID', cut)
"""


def trim_trained(client: redis.Redis, stream: str, group: str, older_than_ms: int) -> int:
    """Deletes the entries of `stream` that `group` has acked and that were added before
    `older_than_ms` (server time, ms); returns how many. Undelivered and pending entries stay."""
    return int(client.eval(TRIM_TRAINED, 1, stream, f"{max(int(older_than_ms), 0)}-0", group))


def group_pending(client: redis.Redis, stream: str, group: str) -> int:
    return int(client.xpending(stream, group)["pending"])


def dedupe_append(pipe, keys: Keys, group_id: str, frame: bytes, lease_id: str = "",
                  ttl_s: int = SEEN_TTL_S) -> None:
    """Queues the atomic dedupe + XADD of one frame on `pipe` (reply: 1 added, 0 duplicate, -1 its
    lease `lease_id` is gone). A leaseless frame (`lease_id` "") keeps SEEN_TTL_S whatever `ttl_s`.

    Plain EVAL, not EVALSHA: a restarted redis-server has an empty script cache, and a retried
    pipeline would hit NOSCRIPT; the script text is ~300 bytes next to frames of kilobytes.
    """
    pipe.eval(DEDUPE_APPEND, 3, keys.seen(group_id), keys.trajectories, keys.prompts, frame,
              ttl_s if lease_id else SEEN_TTL_S, PROMPT_GROUP, lease_id)


def release_prompts(client: redis.Redis, keys: Keys, expected_released: int, epoch: int, index: int,
                    frames: list[bytes]) -> bool:
    """Appends `frames` to the prompts stream and moves the cursor, iff nobody moved it meanwhile."""
    args = [expected_released, epoch, index, expected_released + len(frames), *frames]
    return bool(client.eval(RELEASE_PROMPTS, 2, keys.cursor, keys.prompts, *args))


def requeue_prompts(client: redis.Redis, keys: Keys, entry_ids: list) -> int:
    if not entry_ids:
        return 0
    return int(client.eval(RECLAIM_REQUEUE, 1, keys.prompts, PROMPT_GROUP, *entry_ids))


def ack_dropped(client: redis.Redis, keys: Keys, entry_ids: list) -> int:
    if not entry_ids:
        return 0
    from asyncrl.protocol.notify import MAXLEN

    return int(client.eval(ACK_DROPPED, 3, keys.trajectories, keys.learner, keys.notify, LEARNER_GROUP, MAXLEN,
                           *entry_ids))


def set_and_notify(client: redis.Redis, keys: Keys, key: str, value, kind: str) -> None:
    """SET `key` and append the `kind` wake-up in one transaction (one round trip; never the
    wake-up without the state it announces)."""
    from asyncrl.protocol.notify import publish

    pipe = client.pipeline(transaction=True)
    pipe.set(key, value)
    publish(pipe, keys, kind)
    pipe.execute()


def stream_id_ms(entry_id) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(raw.split("-", 1)[0])


def oldest_unacked_ms(client: redis.Redis, stream: str, group: str) -> int | None:
    """Server time (ms) of the oldest entry the group has not acked (pending or undelivered), or None."""
    oldest = None
    summary = client.xpending(stream, group)
    if summary["pending"]:
        oldest = stream_id_ms(summary["min"])
    else:
        for info in client.xinfo_groups(stream):
            if info["name"] in (group, group.encode()):
                first = client.xrange(stream, min=f"({_as_str(info['last-delivered-id'])}", count=1)
                if first:
                    oldest = stream_id_ms(first[0][0])
    return oldest


def _as_str(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
