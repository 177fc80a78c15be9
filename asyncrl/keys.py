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
    def gen_pattern(self) -> str:
        return self._k("gen:*")

    @property
    def events(self) -> str:
        return self._k("events")

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
    def learner(self) -> str:
        return self._k("learner")

    @property
    def stop(self) -> str:
        return self._k("stop")

    @property
    def exporters(self) -> str:
        """Hash: role (`buffer`, `learner`, `generator:{id}`) -> its Prometheus /metrics URL."""
        return self._k("exporters")

    @property
    def lag_history(self) -> str:
        """List (newest first, capped): one JSON version-lag histogram per trained batch."""
        return self._k("lag_history")


def connect(url: str):
    """A redis-py client with bytes replies; fails fast with the URL if Redis is not there."""
    import redis

    if not url:
        raise ValueError("buffer.redis_url is empty: start Redis and pass buffer.redis_url=redis://HOST:PORT/0 "
                         "(or use `asyncrl run`, which starts one)")
    client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10,
                                  health_check_interval=10, retry_on_timeout=True)
    try:
        client.ping()
    except redis.exceptions.ConnectionError as e:
        raise ConnectionError(f"cannot reach Redis at {url}: {e}") from e
    return client


def log_event(client, keys: Keys, kind: str, **fields) -> None:
    """Appends to the run's events stream (joins, leaves, syncs, drops, restarts), capped in length."""
    import time

    payload = {"kind": kind, "t": f"{time.time():.3f}", **{k: str(v) for k, v in fields.items()}}
    client.xadd(keys.events, payload, maxlen=10_000, approximate=True)
