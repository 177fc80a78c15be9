"""Every generator the run has seen, kept past its heartbeat: the `members` hash.

A heartbeat key (`gen:{id}`) expires generator.heartbeat_ttl_s after its last write, so a frozen or
dead generator would simply vanish from the fleet. Each heartbeat also writes a summary of itself
under its id in `members` (no TTL); a clean leave deletes it, and the buffer's reclaimer forgets a
member whose heartbeat is gone, that holds no prompt lease any more, and whose last heartbeat is
older than buffer.lease_timeout_s (by then its leases have been reclaimed). So the hash is bounded
by the generators alive or lately dead, and `asyncrl status` names each as live, stalled or gone.
"""

from __future__ import annotations

import json
import time

from asyncrl.protocol.keys import PROMPT_GROUP, Keys

LIVE, STALLED, GONE = "live", "stalled", "gone"


def summary(hb_fields: dict, last_group: str, last_group_at: float | None) -> str:
    """The JSON a heartbeat writes under its id in `members` (`hb_fields`: the heartbeat's own fields)."""
    keep = ("state", "version", "groups", "pid", "host", "updated_at")
    return json.dumps({**{k: hb_fields.get(k) for k in keep}, "last_group": last_group,
                       "last_group_at": last_group_at})


def stale_after_s(heartbeat_s: float, heartbeat_ttl_s: float) -> float:
    """Heartbeat age past which a member counts as stalled: three missed beats (at least 2 s), and
    always before its key expires, so a frozen process is named while its key still exists."""
    return min(max(3 * heartbeat_s, 2.0), heartbeat_ttl_s * 0.8)


def leases_by_consumer(client, keys: Keys) -> dict[str, int]:
    """Prompt leases held, by generator id (the consumers of the prompts stream's group)."""
    try:
        consumers = client.xpending(keys.prompts, PROMPT_GROUP).get("consumers") or []
    except Exception as e:  # no prompts stream before the buffer's set-up
        if "no such key" not in str(e).lower() and "nogroup" not in str(e).lower():
            raise
        return {}
    out = {}
    for c in consumers:
        name = c["name"].decode() if isinstance(c["name"], bytes) else str(c["name"])
        out[name] = int(c["pending"])
    return out


def read_members(client, keys: Keys, heartbeat_s: float, heartbeat_ttl_s: float,
                 now: float | None = None) -> list[dict]:
    """Every member, sorted by id: its state (live / stalled / gone), last heartbeat, last group and
    the prompt leases it holds. A member is `gone` once its heartbeat key expired."""
    now = time.time() if now is None else now
    raw = client.hgetall(keys.members)
    ids = sorted(k.decode() for k in raw)
    pipe = client.pipeline(transaction=False)
    for gid in ids:
        pipe.hget(keys.gen(gid), "updated_at")
    live_at = pipe.execute() if ids else []
    leases = leases_by_consumer(client, keys)
    stale = stale_after_s(heartbeat_s, heartbeat_ttl_s)
    out = []
    for gid, beat in zip(ids, live_at, strict=True):
        try:
            info = json.loads(raw[gid.encode()])
        except ValueError:
            info = {}
        last = float(beat) if beat is not None else float(info.get("updated_at") or 0.0)
        age = max(now - last, 0.0) if last else None
        state = GONE if beat is None else (STALLED if age is not None and age > stale else LIVE)
        out.append({"id": gid, "state": state, "last_heartbeat": last or None, "heartbeat_age_s": age,
                    "last_group": info.get("last_group") or None, "last_group_at": info.get("last_group_at"),
                    "groups": info.get("groups"), "leases": leases.get(gid, 0), "role_state": info.get("state"),
                    "version": info.get("version"), "pid": info.get("pid"), "host": info.get("host")})
    return out


def prune(client, keys: Keys, lease_timeout_s: float, now: float | None = None) -> list[str]:
    """Forgets members whose heartbeat is gone, that hold no lease, and whose last heartbeat is older
    than `lease_timeout_s`; returns their ids. (A clean leave deletes its own entry at once.)"""
    now = time.time() if now is None else now
    raw = client.hgetall(keys.members)
    if not raw:
        return []
    leases = leases_by_consumer(client, keys)
    forgotten = []
    for name, value in raw.items():
        gid = name.decode()
        try:
            last = float(json.loads(value).get("updated_at") or 0.0)
        except (ValueError, AttributeError):
            last = 0.0
        if now - last > lease_timeout_s and not leases.get(gid) and not client.exists(keys.gen(gid)):
            forgotten.append(gid)
    if forgotten:
        client.hdel(keys.members, *forgotten)
    return forgotten
