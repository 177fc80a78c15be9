"""Redis operations shared by the roles: stream set-up, atomic dedupe + append, stream depth, trimming."""

from __future__ import annotations

import redis

from asyncrl.keys import LEARNER_GROUP, PROMPT_GROUP, Keys

# Dedupe and append in one atomic step, so a crash between the two can neither lose a group
# (marked seen, never appended) nor let a late duplicate in.
DEDUPE_APPEND = """
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[2]) then
  redis.call('XADD', KEYS[2], '*', 'data', ARGV[1])
  return 1
end
return 0
"""

SEEN_TTL_S = 7 * 24 * 3600


def ensure_groups(client: redis.Redis, keys: Keys) -> None:
    for stream, group in ((keys.prompts, PROMPT_GROUP), (keys.trajectories, LEARNER_GROUP)):
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def group_lag(client: redis.Redis, stream: str, group: str) -> int:
    """Entries in `stream` not yet delivered to `group` (Redis >= 7 reports it as `lag`)."""
    for info in client.xinfo_groups(stream):
        if info["name"] in (group, group.encode()):
            lag = info.get("lag")
            if lag is None:  # lag is unknown after some deletions; fall back to an upper bound
                return int(client.xlen(stream))
            return int(lag)
    return 0


def group_pending(client: redis.Redis, stream: str, group: str) -> int:
    return int(client.xpending(stream, group)["pending"])
