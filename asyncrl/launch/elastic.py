"""Elastic scaling: the run's scale requests and the local launcher's side of them.

`asyncrl scale CONFIG --generators +K|-K` asks the backend the run published in its Redis (`deploy`
hash, written at start) through its entry in asyncrl/launch/backends.py:
- `local` (`asyncrl run`) and `ray` (the Ray driver): the request goes on the run's `scale` list,
  which the launcher (`LocalScaler` here) / driver watches and acts on (start generator children or
  actors; SIGTERM the newest ones, which drain and exit 0);
- `slurm`: the `asyncrl scale` process submits generator jobs, or cancels the newest with SIGTERM (they drain).

Added generators join on their own: they heartbeat, and the learner's next fleet check opens a new
weight-group epoch with them. Removed generators stop leasing, push what is in flight, and leave.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time

from asyncrl.protocol.keys import Keys, log_event

log = logging.getLogger(__name__)


def parse_delta(text: str) -> int:
    try:
        delta = int(text)
    except ValueError:
        raise ValueError(f"--generators takes +K or -K (e.g. +1, -2), got {text!r}") from None
    if delta == 0 or not text.strip().startswith(("+", "-")):
        raise ValueError(f"--generators takes a signed, non-zero count (+1, -2), got {text!r}")
    return delta


def publish_backend(client, keys: Keys, backend: str, **fields) -> None:
    client.delete(keys.deploy)
    client.hset(keys.deploy, mapping={"backend": backend, "t": time.time(), **{k: str(v) for k, v in fields.items()}})


def request_scale(client, keys: Keys, delta: int) -> None:
    client.rpush(keys.scale, json.dumps({"delta": delta, "t": time.time()}))


def pop_requests(client, keys: Keys) -> list[int]:
    deltas = []
    while (raw := client.lpop(keys.scale)) is not None:
        try:
            deltas.append(int(json.loads(raw)["delta"]))
        except (ValueError, KeyError, TypeError) as e:
            log.error("bad scale request %r dropped: %r", raw, e)
    return deltas


class LocalScaler:
    """The launcher's side: generator children started and stopped on request."""

    def __init__(self, launcher, client, keys: Keys, cfg_path, poll_s: float = 0.5):
        self.launcher = launcher
        self.client = client
        self.keys = keys
        self.cfg_path = cfg_path
        self.poll_s = poll_s
        self.removed: set[str] = set()  # scaled-down children: their exit is not a failure
        self._next = launcher.cfg.generator.num_generators
        self._last = 0.0
        publish_backend(client, keys, "local", pid=os.getpid())
        from asyncrl.protocol.security import redis_url_file

        # `asyncrl scale CONFIG` finds the launcher's Redis here (no password in it).
        redis_url_file(launcher.cfg.run_dir).write_text(launcher.cfg.buffer.redis_url + "\n")

    def generators(self) -> list[str]:
        return [n for n, c in self.launcher.children.items()
                if n.startswith("generator-") and n not in self.removed and c.poll() is None]

    def poll(self) -> None:
        now = time.monotonic()
        if now - self._last < self.poll_s:
            return
        self._last = now
        for delta in pop_requests(self.client, self.keys):
            if delta > 0:
                for _ in range(delta):
                    gid = f"g{self._next}"
                    self._next += 1
                    self.launcher._spawn(f"generator-{gid}", [sys.executable, "-m", "asyncrl", "generator",
                                                              str(self.cfg_path), "--id", gid], role="generator")
                    log_event(self.client, self.keys, "scale_up", id=gid, backend="local")
                    log.info("scale: added generator %s", gid)
            else:
                for name in self.generators()[::-1][:-delta]:
                    # SIGTERM to the generator itself (not its engine): it drains, then shuts its engine down.
                    os.kill(self.launcher.children[name].pid, signal.SIGTERM)
                    self.removed.add(name)
                    log_event(self.client, self.keys, "scale_down", id=name.removeprefix("generator-"),
                              backend="local")
                    log.info("scale: draining %s", name)
