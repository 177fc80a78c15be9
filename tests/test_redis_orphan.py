"""A redis-server started by a role (the deploy core, the local launcher) never outlives it: a SIGKILL
of the starting process, as `ray job stop` or scancel past its grace deliver, takes Redis with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from tests.buffer_support import REPO

STARTER = """
import sys, time
from asyncrl.launch.redis_server import LocalRedis
r = LocalRedis(sys.argv[1]).start()
print(r.proc.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_starter_leaves_no_redis_server_behind(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path / "redis")], cwd=REPO,
                               stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    redis_pid = int(starter.stdout.readline())
    try:
        assert psutil.pid_exists(redis_pid)
        starter.send_signal(signal.SIGKILL)
        starter.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if psutil.Process(redis_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"redis-server {redis_pid} still runs after its starter was killed")
    finally:
        try:
            os.kill(redis_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
