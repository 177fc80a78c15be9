"""A finished run seen from its run folder: `asyncrl status` and `asyncrl inspect` after the run.

`asyncrl run` starts its own redis-server with AOF in `{run_dir}/redis` and stops it at the end, so
afterwards the URL in `{run_dir}/config.yaml` answers no more (or, worse, another run's server has
its port). The AOF holds the run's whole Redis state, so a copy of it is opened by a private
redis-server on a free loopback port, read, and thrown away; the run folder is never written.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from asyncrl.config import Config
from asyncrl.observe.metrics import complete_rows


@dataclass
class RunRedis:
    url: str
    ended: bool  # the run's own Redis is gone: `url` is a private copy of its saved state
    note: str = ""  # what was read, for the user (empty while the run's Redis is up)


def _serves_this_run(url: str, cfg: Config, check_dir: bool) -> bool:
    """Whether `url` is up and, for a launcher's local Redis (`check_dir`), is that run's server (its
    port may have been taken by another redis-server since the run ended)."""
    import redis

    from asyncrl.protocol.keys import _auth_kwargs
    from asyncrl.protocol.retry import RETRYABLE

    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5, retry=None,
                                      decode_responses=True, **_auth_kwargs())
        client.ping()
        saved = cfg.run_dir / "redis"
        if not check_dir or not saved.is_dir():
            return True  # a Redis the run was given (buffer.redis_url): nothing to compare with
        served = client.config_get("dir").get("dir", "")
    except (*RETRYABLE, redis.ResponseError):
        return False
    return not served or Path(served).resolve() == saved.resolve()


@contextlib.contextmanager
def open_run(cfg: Config, url: str, given: bool = False) -> Iterator[RunRedis]:
    """The run's Redis while it is up; else a private copy of the state its run folder saved.
    `given`: the user named this URL (`--redis`), so any server answering there is taken as the run's."""
    if _serves_this_run(url, cfg, check_dir=not given):
        yield RunRedis(url, ended=False)
        return
    aof = cfg.run_dir / "redis" / "appendonlydir"
    if not aof.is_dir():
        raise ConnectionError(f"cannot reach Redis at {url}, and {cfg.run_dir}/redis holds no saved state of "
                              f"run {cfg.run.name!r} (only a run started by `asyncrl run` saves one there)")
    from asyncrl.launch.redis_server import LocalRedis

    with tempfile.TemporaryDirectory(prefix="asyncrl-ended-") as tmp:
        shutil.copytree(aof, Path(tmp) / "appendonlydir")
        server = LocalRedis(tmp, appendfsync="no").start()
        try:
            yield RunRedis(server.url, ended=True,
                           note=f"run {cfg.run.name!r} has ended (its Redis at {url} is gone): read from its "
                                f"run folder, {aof}")
        finally:
            server.stop()


def last_metrics_row(run_dir: Path) -> dict | None:
    rows = complete_rows(run_dir / "metrics.jsonl")
    return rows[-1] if rows else None


def newest_weights(cfg: Config) -> tuple[str, str]:
    """The newest weights the learner exported and what they are: `{run_dir}/hf-final` when this run
    wrote it (newer than the run's config.yaml, which the launcher writes at the start), else the
    starting weights at model.path."""
    final = cfg.run_dir / "hf-final"
    started = cfg.run_dir / "config.yaml"
    weights = sorted(final.glob("*.safetensors"))
    if weights and (not started.exists() or weights[0].stat().st_mtime >= started.stat().st_mtime):
        row = last_metrics_row(cfg.run_dir)
        version = f", version {row['version']}" if row and "version" in row else ""
        return str(final), f"the learner's final export{version}"
    return cfg.model_path, "the starting weights (model.path): the learner has exported none yet"
