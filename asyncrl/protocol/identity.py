"""A run's identity in Redis, so that two runs never mix their state.

The hash `asyncrl:{run}:run` is written by whichever role (or launcher) comes first: a random `id`,
`created_at`, `created_by`, the `schema_version` of the asyncrl that wrote it, and `state` (`live`
until the learner finishes, then `finished` with `finished_at` and the final `version`). Every role
calls `claim` before it reads or writes anything else of the run:

- no state under the name: the identity is created (`live`) and the role goes on;
- a live run of our schema version: the role joins it (a sibling started first, or a role
  restarted after a crash);
- a finished run (`state=finished`, or a `stop` key: the learner or a launcher ended it), or a
  foreign one (another schema version): refused with one line naming what was found and the ways
  out, unless `run.resume=true` (continue a finished run: it is marked live again, the stop key
  removed) or `run.reset=true` (clear every key of the name and start afresh);
- state with no identity and no stop key (written by hand, by a test, or by an asyncrl that wrote
  no identity): adopted, with a warning.

Why refuse by default: a run started on a finished run's Redis (the same `run.name` on a
redis-server that reloaded its AOF) saw the old stop key (the buffer left a second after it came
up) and the old trajectories (the learner trained on them at a negative version lag), and then
waited forever. The decision is made under a short lock, so siblings started together agree:
the first creates or resets, the others join what it made. A live run is never reset: nothing can
tell it from a sibling that has just claimed it.
"""

from __future__ import annotations

import logging
import time
import uuid

from asyncrl.config import Config, ConfigError
from asyncrl.protocol.keys import Keys, log_event

log = logging.getLogger(__name__)

LOCK_TTL_MS = 10_000  # the claim lock outlives no crashed claimant by more than this
LOCK_WAIT_S = 15.0


class RunConflict(ConfigError):
    """The run's name in this Redis holds a finished or foreign run: the fix is a setting."""


def _text(raw: dict) -> dict[str, str]:
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()}


def read(client, keys: Keys) -> dict[str, str]:
    """The identity hash (empty when there is none)."""
    return _text(client.hgetall(keys.identity))


def _when(t: str | None) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))
    except (TypeError, ValueError):
        return "?"


def describe(ident: dict[str, str], stopped: bool) -> str:
    """What a role found, in a few words: `run 'x' (id 3f2a91c0, created ... by the learner, finished ...)`."""
    if not ident:
        return "the state of an earlier run with no identity" + (", ended (its stop key is set)" if stopped else "")
    parts = [f"id {ident.get('id', '?')[:8]}", f"created {_when(ident.get('created_at'))} by "
             f"{ident.get('created_by', '?')}"]
    if ident.get("state") == "finished":
        parts.append(f"finished {_when(ident.get('finished_at'))} at version {ident.get('version', '?')}")
    elif stopped:
        parts.append("stopped (its stop key is set)")
    if ident.get("schema_version") and ident["schema_version"] != str(_schema_version()):
        parts.append(f"schema version {ident['schema_version']}, this asyncrl writes {_schema_version()}")
    return "a run (" + ", ".join(parts) + ")"


def _schema_version() -> int:
    from asyncrl.protocol.schema import SCHEMA_VERSION

    return SCHEMA_VERSION


def _acquire(client, keys: Keys, token: str) -> None:
    deadline = time.monotonic() + LOCK_WAIT_S
    while not client.set(keys.claim_lock, token, nx=True, px=LOCK_TTL_MS):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{keys.claim_lock} held for over {LOCK_WAIT_S:.0f}s by another role's claim")
        time.sleep(0.05)


_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def clear(client, keys: Keys) -> int:
    """Deletes every key of the run's name but the claim lock; returns how many."""
    names = [k for k in client.scan_iter(f"asyncrl:{keys.run}:*", count=1000) if _str(k) != keys.claim_lock]
    for i in range(0, len(names), 1000):
        client.delete(*names[i:i + 1000])
    return len(names)


def _str(k) -> str:
    return k.decode() if isinstance(k, bytes) else k


def _has_state(client, keys: Keys) -> bool:
    return any(_str(k) != keys.claim_lock for k in client.scan_iter(f"asyncrl:{keys.run}:*", count=1000))


def _create(client, keys: Keys, role: str) -> dict[str, str]:
    ident = {"id": uuid.uuid4().hex, "created_at": f"{time.time():.3f}", "created_by": role,
             "schema_version": str(_schema_version()), "state": "live"}
    client.hset(keys.identity, mapping=ident)
    return ident


def claim(client, keys: Keys, cfg: Config, role: str, url: str = "") -> dict[str, str]:
    """Joins, creates, resumes or resets the run named `cfg.run.name`, as the module docstring says;
    returns its identity. Raises RunConflict (one line: what was found, the ways out) when the
    name holds a finished or foreign run and neither `run.resume` nor `run.reset` is set."""
    token = uuid.uuid4().hex
    _acquire(client, keys, token)
    try:
        return _claim(client, keys, cfg, role, url or cfg.buffer.redis_url)
    finally:
        client.eval(_RELEASE, 1, keys.claim_lock, token)


def _claim(client, keys: Keys, cfg: Config, role: str, url: str) -> dict[str, str]:
    ident = read(client, keys)
    stopped = bool(client.exists(keys.stop))
    foreign = bool(ident) and ident.get("schema_version") != str(_schema_version())
    finished = ident.get("state") == "finished" or stopped
    if ident and not foreign and not finished:
        return ident  # live: a sibling made it, or we are a role restarted into it
    if not ident and not stopped:
        if _has_state(client, keys):
            log.warning("Redis holds state of run %r with no identity (written by hand, or by an older asyncrl): "
                        "adopting it as this run", keys.run)
        ident = _create(client, keys, role)
        log_event(client, keys, "run_created", id=ident["id"], by=role)
        return ident
    found = describe(ident, stopped)
    if cfg.run.reset:
        num = clear(client, keys)
        ident = _create(client, keys, role)
        log.warning("run.reset=true: cleared %d keys of %s under the name %r; started run %s", num, found, keys.run,
                    ident["id"][:8])
        log_event(client, keys, "run_created", id=ident["id"], by=role, reset=num)
        return ident
    if cfg.run.resume and not foreign:
        pipe = client.pipeline(transaction=True)
        pipe.delete(keys.stop)
        pipe.hset(keys.identity, mapping={"state": "live", "resumed_at": f"{time.time():.3f}", "resumed_by": role})
        pipe.hsetnx(keys.identity, "id", uuid.uuid4().hex)
        pipe.hsetnx(keys.identity, "created_at", f"{time.time():.3f}")
        pipe.hsetnx(keys.identity, "created_by", role)
        pipe.hsetnx(keys.identity, "schema_version", str(_schema_version()))
        pipe.execute()
        log.warning("run.resume=true: continuing %s under the name %r", found, keys.run)
        ident = read(client, keys)
        log_event(client, keys, "run_resumed", id=ident.get("id", ""), by=role)
        return ident
    where = f"Redis at {url}" if url else "Redis"
    if foreign:
        raise RunConflict(f"{where} holds {found} under run.name={keys.run!r}, written by another asyncrl: start a "
                          "new run with another run.name, or set run.reset=true to clear it")
    raise RunConflict(f"{where} holds {found} under run.name={keys.run!r}: start a new run with another run.name, "
                      "or set run.resume=true to continue it (run.reset=true clears it)")


def mark_finished(pipe, keys: Keys, version: int) -> None:
    """Queued on the learner's closing pipeline, with the stop key: the run is over."""
    pipe.hset(keys.identity, mapping={"state": "finished", "finished_at": f"{time.time():.3f}",
                                      "version": str(version)})


def claim_from_config(cfg: Config, role: str) -> dict[str, str]:
    """`claim` over a short-lived connection to `buffer.redis_url` (the roles' entry points)."""
    from asyncrl.protocol.keys import connect

    client = connect(cfg.buffer.redis_url, retry_s=cfg.buffer.redis_retry_s)
    try:
        return claim(client, Keys(cfg.run.name), cfg, role)
    finally:
        client.close()
