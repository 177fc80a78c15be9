"""Starts a local `redis-server` on a free port with the persistence the project expects (AOF on)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux PR_SET_PDEATHSIG: this process gets SIGTERM when its parent exits (elsewhere a no-op)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class LocalRedis:
    """A real redis-server child process; `url` is where it listens. Bound to `host` (127.0.0.1 unless
    a multi-node deployment names the node's interface, with a password: see docs/deploy.md)."""

    def __init__(self, data_dir: str | Path, port: int | None = None, appendfsync: str = "everysec",
                 password: str | None = None, host: str = "127.0.0.1", cpus: tuple[int, ...] = ()):
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server not found: install it (Debian: apt-get install -y redis-server) "
                                    "or pass buffer.redis_url=redis://HOST:PORT/0")
        self.data_dir = Path(data_dir).resolve()  # redis-server chdirs to --dir before opening --logfile
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port or free_port(host)
        self.password = password
        args = [exe, "--port", str(self.port), "--bind", host, "--dir", str(self.data_dir),
                "--appendonly", "yes", "--appendfsync", appendfsync, "--save", "",
                "--protected-mode", "yes", "--daemonize", "no", "--logfile", str(self.data_dir / "redis.log")]
        if password:
            args += ["--requirepass", password]
        self.args = args
        self.cpus = cpus  # pinned to these CPUs (asyncrl/launch/affinity.py) when given
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def address_url(self) -> str:
        """The URL without the password (for config dumps and command lines; the password travels in a file)."""
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        from asyncrl.launch.affinity import preexec

        pin = preexec(self.cpus)

        def before_exec() -> None:
            # SIGTERM when the process that started it dies, however it dies: a SIGKILLed deploy core
            # (`ray job stop`, scancel past its grace) leaves no redis-server running.
            _die_with_parent()
            if pin is not None:
                pin()

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=before_exec)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = (self.data_dir / "redis.log").read_text()[-2000:] if (self.data_dir / "redis.log").exists() else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {log}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not listen on {self.port} within {timeout_s}s")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
