"""Checks of the resources a run needs, made before any process of it starts.

Why here and not where each resource is first used: a missing model folder would surface 13 s
into a run as a torchrun traceback (its cause in another role's log), a wrong Redis URL or password
as a 64-line traceback. Each check raises `ConfigError` (a setting is wrong: the key named) or
`ConnectionError` (Redis is not there or will not let us in: the URL named); the CLI prints the one
line and exits 2. Standard library only (plus redis-py for the Redis probe).
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.config import Config, ConfigError

# `org/name` or `name`: what Hugging Face hub ids look like (a path would start with / . ~ or have more parts).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def check_model(cfg: Config) -> None:
    """`model.path` names an existing Hugging Face model folder, or a hub id (fetched by the roles)."""
    path = cfg.model.path
    if not path:
        return  # the tiny model is written into the run directory
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ConfigError(f"model.path: {p} has no config.json (not a Hugging Face model folder)")
        return
    if p.exists():
        raise ConfigError(f"model.path: {p} is a file; it must name a Hugging Face model folder")
    if _HUB_ID.match(path) and "/" in path:
        return
    raise ConfigError(f"model.path: {path} does not exist (a local model folder, or a hub id such as "
                      "Qwen/Qwen2.5-0.5B-Instruct)")


def check_secrets(cfg: Config) -> None:
    """Every secret file the config names exists (its contents are read once, here)."""
    from asyncrl.protocol.security import read_secret

    for key in ("redis_password_file", "run_token_file"):
        if getattr(cfg.deploy, key):
            read_secret(getattr(cfg.deploy, key))
    if cfg.deploy.curve_keys_dir and not (Path(cfg.deploy.curve_keys_dir).expanduser() / "server.key").exists():
        raise ConfigError(f"deploy.curve_keys_dir: {cfg.deploy.curve_keys_dir} has no server.key (write one with "
                          "`asyncrl keys generate --out DIR`)")


def check_redis(cfg: Config) -> None:
    """Redis at `buffer.redis_url` answers a PING with our password (when the URL is set)."""
    if not cfg.buffer.redis_url:
        return
    from asyncrl.protocol.keys import connect

    connect(cfg.buffer.redis_url).close()


def check_all(cfg: Config, redis_required: bool, model: bool = True) -> None:
    """What a run or role needs before it starts anything. `redis_required`: a role started on its own
    needs `buffer.redis_url`; `asyncrl run` starts a local Redis when it is empty. `model`: the buffer
    loads no model (it reads the vocabulary size from the folder when there is one)."""
    if model:
        check_model(cfg)
    check_secrets(cfg)
    if redis_required and not cfg.buffer.redis_url:
        raise ConfigError("buffer.redis_url is empty: a role started on its own needs the run's Redis "
                          "(buffer.redis_url=redis://HOST:PORT/0), or use `asyncrl run`, which starts one")
    check_redis(cfg)
