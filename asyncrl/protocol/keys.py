"""Redis key names (all under `asyncrl:{run}:`) and the small helpers every role shares."""

from __future__ import annotations

from dataclasses import dataclass

PROMPT_GROUP = "generators"  # consumer group on the prompts stream
LEARNER_GROUP = "learner"  # consumer group on the trajectories stream


@dataclass(frozen=True)
class Keys:
    run: str

    def _k(self, name: str) -> str:
        return f"asyncrl:{self.run}:{name}"

    @property
    def prompts(self) -> str:
        return self._k("prompts")

    @property
    def trajectories(self) -> str:
        return self._k("trajectories")

    def seen(self, group_id: str) -> str:
        return self._k(f"seen:{group_id}")

    @property
    def version(self) -> str:
        return self._k("version")

    @property
    def wgroup(self) -> str:
        return self._k("wgroup")

    @property
    def wsync(self) -> str:
        return self._k("wsync")

    def gen(self, generator_id: str) -> str:
        return self._k(f"gen:{generator_id}")

    @property
    def notify(self) -> str:
        """Capped stream of wake-ups (`k`: version / weights / prompts) after state others wait for (asyncrl/protocol/notify.py)."""
        return self._k("notify")

    @property
    def members(self) -> str:
        """Hash: generator id -> JSON of its last heartbeat's summary, kept after the heartbeat key expires
        so that status can name a frozen or dead member (asyncrl/protocol/members.py)."""
        return self._k("members")

    @property
    def gen_pattern(self) -> str:
        return self._k("gen:*")

    @property
    def events(self) -> str:
        return self._k("events")

    @property
    def requeue(self) -> str:
        """List: group ids the learner dropped unused, whose prompts the buffer releases again first."""
        return self._k("requeue")

    @property
    def cursor(self) -> str:
        return self._k("cursor")

    @property
    def metrics(self) -> str:
        return self._k("metrics")

    @property
    def ingest_addr(self) -> str:
        return self._k("ingest_addr")

    @property
    def buffer_instance(self) -> str:
        """A fresh id per buffer process start: generators re-send unconfirmed groups when it changes."""
        return self._k("buffer_instance")

    @property
    def learner(self) -> str:
        return self._k("learner")

    @property
    def sampling(self) -> str:
        """JSON: the learner's temperature/top_p/top_k, checked by every generator at start (asyncrl/protocol/sampling.py)."""
        return self._k("sampling")

    @property
    def stop(self) -> str:
        return self._k("stop")

    @property
    def stop_request(self) -> str:
        """Asks the learner to end the run now as if at run.max_steps (checkpoint, export, stop key)."""
        return self._k("stop_request")

    @property
    def exporters(self) -> str:
        """Hash: role (`buffer`, `learner`, `generator:{id}`) -> its Prometheus /metrics URL."""
        return self._k("exporters")

    @property
    def timeline(self) -> str:
        """Hash: start-up milestone -> wall-clock seconds (asyncrl/observe/timeline.py)."""
        return self._k("timeline")

    @property
    def scale(self) -> str:
        """List of scale requests (`+K`/`-K` generators) for the backend that runs the fleet (asyncrl/launch/elastic.py)."""
        return self._k("scale")

    @property
    def deploy(self) -> str:
        """Hash: which backend runs this run (`local`, `slurm`, `ray`) and how to reach it."""
        return self._k("deploy")

    @property
    def quarantine(self) -> str:
        """Dead-letter stream: trajectory entries the learner could not train, with the reason (learners/quarantine.py)."""
        return self._k("quarantine")

    @property
    def identity(self) -> str:
        """Hash: who started the run and whether it is live or finished (asyncrl/protocol/identity.py)."""
        return self._k("run")

    @property
    def claim_lock(self) -> str:
        """Held for a moment while a role claims the run (asyncrl/protocol/identity.py)."""
        return self._k("claim_lock")

    @property
    def lag_history(self) -> str:
        """List (newest first, capped): one JSON version-lag histogram per trained batch."""
        return self._k("lag_history")


def _check_url(url: str) -> None:
    if not url:
        from asyncrl.config import ConfigError

        raise ConfigError("buffer.redis_url is empty: start Redis and pass buffer.redis_url=redis://HOST:PORT/0 "
                         "(or use `asyncrl run`, which starts one)")


def connect(url: str, retry_s: float = 600.0):
    """A redis-py client with bytes replies; fails fast with the URL if Redis is not there at start.

    Once connected, a lost Redis (restart, failover) is retried with backoff for up to `retry_s`
    (asyncrl/protocol/retry.py), so every role rides out a redis-server restart.
    """
    import redis

    from asyncrl.protocol.retry import RETRYABLE, LoudRetry

    _check_url(url)
    auth = _auth_kwargs()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=10, retry=None, **auth).ping()
    except (*RETRYABLE, redis.ResponseError) as e:
        raise _unreachable(url, e) from e
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10, health_check_interval=10,
                                retry=LoudRetry(retry_s), retry_on_error=list(RETRYABLE), **auth)


def _unreachable(url: str, e: Exception) -> ConnectionError:
    """One line for a Redis that is not there or does not let us in (a missing or wrong password
    is named as such, not as "cannot reach")."""
    text = str(e)
    if "NOAUTH" in text or "Authentication required" in text or "already authenticated" in text:
        return ConnectionError(f"Redis at {url} requires a password: set deploy.redis_password_file to a file "
                               "holding it")
    if "WRONGPASS" in text or "invalid username-password" in text or "without any password configured" in text:
        return ConnectionError(f"Redis at {url} refused the password in deploy.redis_password_file ({text})")
    return ConnectionError(f"cannot reach Redis at {url}: {e}")


def _auth_kwargs() -> dict:
    """The password from deploy.redis_password_file (asyncrl/protocol/security.py), when one is set."""
    from asyncrl.protocol.security import redis_password

    password = redis_password()
    return {"password": password} if password else {}


async def aconnect(url: str, retry_s: float = 600.0):
    """The asyncio twin of `connect` (used by generators)."""
    import redis.asyncio as aioredis

    from asyncrl.protocol.retry import RETRYABLE, AsyncLoudRetry

    _check_url(url)
    auth = _auth_kwargs()
    probe = aioredis.Redis.from_url(url, socket_connect_timeout=10, retry=None, **auth)
    try:
        await probe.ping()
    except (*RETRYABLE, aioredis.ResponseError) as e:
        raise _unreachable(url, e) from e
    finally:
        await probe.aclose()
    return aioredis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10, health_check_interval=10,
                                   retry=AsyncLoudRetry(retry_s), retry_on_error=list(RETRYABLE), **auth)


def log_event(client, keys: Keys, kind: str, **fields) -> None:
    """Appends to the run's events stream (joins, leaves, syncs, drops, restarts), capped in length."""
    import time

    payload = {"kind": kind, "t": f"{time.time():.3f}", **{k: str(v) for k, v in fields.items()}}
    client.xadd(keys.events, payload, maxlen=10_000, approximate=True)
