"""The first job of a scheduled run (Slurm job 1, the Ray driver's core actor): Redis and the buffer.

`python -m asyncrl.launch.deploy_core core CONFIG --backend NAME`: starts redis-server bound to
`deploy.bind_host` (with the password of `deploy.redis_password_file`), publishes its address
(without the password) in `{run_dir}/redis_url` for the other jobs, records the backend in the
run's Redis (`asyncrl scale` looks it up in asyncrl/launch/backends.py), runs the buffer as a child,
and stops Redis once the run is over (the learner set the stop key and the buffer left) or on
SIGTERM (scancel).

With `--wait-for-driver` (the Ray driver's core) the driver decides when the run is over for Redis:
after the buffer left, the core keeps Redis up until the driver's SIGTERM (sent once the learner and
the generators are gone, so no role calls a Redis that has already stopped), for at most DRIVER_LINGER_S.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.logs import setup_logging

log = logging.getLogger("asyncrl.launch.deploy_core")

LEAVE_GRACE_S = 60.0  # after the buffer left: time for generators to drain before Redis goes
DRIVER_LINGER_S = 240.0  # --wait-for-driver: after that, Redis waits this long at most for the driver's SIGTERM


def wait_redis_url(run_dir: Path, timeout_s: float = 600.0, exit_code=None) -> str:
    """The address the core published; `exit_code()` (the core's exit code, None while it runs) ends
    the wait at once when the core died before publishing."""
    from asyncrl.protocol.security import redis_url_file

    f = redis_url_file(run_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if f.exists() and (url := f.read_text().strip()):
            return url
        if exit_code is not None and (code := exit_code()) is not None:
            raise RuntimeError(f"the core (Redis + buffer) exited with {code} before publishing the run's Redis "
                               "address; its log says why")
        time.sleep(0.5)
    raise TimeoutError(f"the run's Redis address did not appear in {f} within {timeout_s:.0f}s: "
                       "is the core job (Redis + buffer) running?")


def _wait_generators_left(client, keys, stopping: list) -> None:
    """The run is over (stop key): generators drain into Redis and log their leave; Redis must outlive
    that. Live heartbeats first, then the joins/leaves balance (a killed generator never leaves: bounded)."""
    deadline = time.monotonic() + LEAVE_GRACE_S
    no_heartbeat_since = None
    while time.monotonic() < deadline and not stopping:
        time.sleep(0.5)
        if list(client.scan_iter(keys.gen_pattern)):
            no_heartbeat_since = None
            continue
        no_heartbeat_since = no_heartbeat_since or time.monotonic()
        kinds = [f.get(b"kind") for _, f in client.xrange(keys.events)]
        if kinds.count(b"generator_leave") >= kinds.count(b"generator_join"):
            break
        if time.monotonic() - no_heartbeat_since > 10:
            break
    time.sleep(2.0)  # the last leaver's final Redis calls


def _start_redis(cfg):
    """redis-server on deploy.bind_host, and (server, the address others use, a client of it)."""
    from asyncrl.launch.affinity import cpus_of
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.protocol.keys import connect
    from asyncrl.protocol.security import advertised_host, redis_password

    host = cfg.deploy.bind_host
    redis = LocalRedis(cfg.run_dir / "redis", appendfsync=cfg.buffer.appendfsync, password=redis_password(),
                       host=host, cpus=cpus_of(cfg, "buffer")).start()  # the buffer pins itself
    url = f"redis://{advertised_host(host, cfg.deploy.advertise_host)}:{redis.port}/0"
    client = connect(f"redis://127.0.0.1:{redis.port}/0" if host in ("0.0.0.0", "::") else url)
    return redis, url, client


def _publish_url(url_file: Path, url: str) -> None:
    tmp = url_file.with_suffix(".tmp")
    tmp.write_text(url + "\n")
    tmp.replace(url_file)  # atomic: readers never see half an address


def _start_buffer(config_path: str, overrides: list[str], url: str, run_dir: Path) -> subprocess.Popen:
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "asyncrl", "buffer", config_path, *overrides,
                             f"buffer.redis_url={url}"],
                            stdout=open(run_dir / "logs" / "buffer.log", "ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _serve(buffer: subprocess.Popen, client, keys, wait_for_driver: bool, run_dir: Path, stopping: list) -> int:
    """Waits for the buffer to leave (or a signal), then keeps Redis up while the run winds down;
    returns the core's exit code."""
    while buffer.poll() is None and not stopping:
        time.sleep(0.5)
    if stopping:
        log.warning("core: signalled, stopping the buffer and Redis")
        return 0
    if buffer.returncode != 0:
        log.error("buffer exited with %d (see %s/logs/buffer.log)", buffer.returncode, run_dir)
        return 1
    _wait_generators_left(client, keys, stopping)
    deadline = time.monotonic() + DRIVER_LINGER_S
    while wait_for_driver and not stopping and time.monotonic() < deadline:
        time.sleep(0.2)
    return 0


def _stop_buffer(buffer: subprocess.Popen) -> None:
    if buffer.poll() is None:
        buffer.terminate()
        try:
            buffer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            buffer.kill()


def run_core(config_path: str, backend: str, overrides: list[str] | None = None, wait_for_driver: bool = False) -> int:
    from asyncrl.config import load_config
    from asyncrl.launch.affinity import check_available
    from asyncrl.launch.elastic import publish_backend
    from asyncrl.protocol.keys import Keys
    from asyncrl.protocol.security import redis_url_file, set_redis_password_file

    overrides = list(overrides or [])
    cfg = load_config(config_path, overrides)
    setup_logging(cfg.logging.level)
    set_redis_password_file(cfg.deploy.redis_password_file)
    check_available(cfg, ("buffer",))
    run_dir = cfg.run_dir
    url_file = redis_url_file(run_dir)
    url_file.unlink(missing_ok=True)
    if not cfg.run.resume:
        shutil.rmtree(run_dir / "redis", ignore_errors=True)  # a fresh run starts from an empty AOF
        if (run_dir / "metrics.jsonl").exists():
            (run_dir / "metrics.jsonl").rename(run_dir / f"metrics.{int(time.time())}.jsonl")
    host = cfg.deploy.bind_host
    if host not in ("127.0.0.1", "localhost", "::1") and not cfg.deploy.redis_password_file:
        # redis-server's protected mode refuses every non-loopback client of a server without a
        # password: no generator or learner on another node could use it.
        print(f"asyncrl core: deploy.bind_host={host} needs deploy.redis_password_file (redis-server refuses "
              "other hosts without a password; `asyncrl keys token --out FILE` makes one)", file=sys.stderr, flush=True)
        return 2
    redis, url, client = _start_redis(cfg)
    keys = Keys(cfg.run.name)
    client.delete(keys.stop)
    publish_backend(client, keys, backend, host=socket.gethostname(), job=os.environ.get("SLURM_JOB_ID", ""))
    _publish_url(url_file, url)
    log.info("core up: redis=%s run_dir=%s backend=%s", url, run_dir, backend)
    buffer = _start_buffer(config_path, overrides, url, run_dir)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(1))
    try:
        code = _serve(buffer, client, keys, wait_for_driver, run_dir, stopping)
    finally:
        _stop_buffer(buffer)
        url_file.unlink(missing_ok=True)
        redis.stop()
    log.info("core: done (exit %d)", code)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m asyncrl.launch.deploy_core")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("core")
    c.add_argument("config")
    c.add_argument("overrides", nargs="*", help="dotted overrides (the Ray driver's: the node's own bind address)")
    c.add_argument("--backend", required=True, help="the backend that runs the fleet (asyncrl/launch/backends.py), "
                   "published in the run's Redis for `asyncrl scale`")
    c.add_argument("--wait-for-driver", action="store_true", help="after the buffer left, keep Redis up until "
                   f"SIGTERM (at most {DRIVER_LINGER_S:.0f} s): a driver that outlives the roles stops the core")
    w = sub.add_parser("wait-redis", help="print the run's Redis address once the core job published it")
    w.add_argument("run_dir")
    w.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.cmd == "core":
        return run_core(args.config, args.backend, args.overrides, args.wait_for_driver)
    print(wait_redis_url(Path(args.run_dir), args.timeout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
