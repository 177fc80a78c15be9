"""Helpers for the buffer tests (not fixtures): configs without a model, the buffer as a thread or as
a real `asyncrl buffer` process, and a prompt-leasing pusher built on the generator's real outbox."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from asyncrl.config import dump_yaml, load_config
from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, aconnect
from buffers.service import BufferService
from generators.outbox import GroupOutbox
from tests.helpers import make_group

REPO = Path(__file__).resolve().parent.parent


def buffer_cfg(tmp_path, redis, *overrides):
    """A config for buffer-only tests: no model is loaded by the buffer, so none is written. The
    tests push synthetic group ids, so the released-id check is off unless an override turns it on."""
    return load_config(None, [f"run.dir={tmp_path / 'runs'}", f"model.path={tmp_path / 'no-model'}",
                              f"buffer.redis_url={redis.url}", "buffer.check_released=false", *overrides])


def wait_for(pred, timeout=15.0, every=0.05) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(every)
    return False


def start_thread(cfg) -> tuple[BufferService, threading.Thread]:
    svc = BufferService(cfg)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    assert wait_for(lambda: svc.client.get(svc.keys.ingest_addr) == svc.ingest_addr.encode(), 10)
    return svc, t


def push(addr: str, frames: list[bytes], linger_ms: int = 5000) -> None:
    s = zmq.Context.instance().socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, linger_ms)
    s.connect(addr)
    for f in frames:
        s.send(f)
    s.close()


class BufferProcess:
    """A real `python -m asyncrl buffer CONFIG` child; `kill()` is SIGKILL."""

    def __init__(self, cfg, tmp_path: Path, name: str = "buffer"):
        self.cfg_path = tmp_path / f"{name}.yaml"
        self.cfg_path.write_text(dump_yaml(cfg))
        self.log_path = tmp_path / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, client, keys: Keys, timeout: float = 30.0) -> BufferProcess:
        old = client.get(keys.buffer_instance)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "buffer", str(self.cfg_path)], cwd=REPO,
                                     stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        ok = wait_for(lambda: client.get(keys.buffer_instance) not in (None, old) and client.get(keys.ingest_addr),
                      timeout, 0.1)
        assert ok, f"buffer did not come up: {self.log_path.read_text()[-3000:]}"
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


class LeasingPusher:
    """Does what a generator does with prompts, minus the model: leases them (XREADGROUP), builds each
    group, and hands it to the generator's real `GroupOutbox`, which acks the prompt once ingested."""

    def __init__(self, cfg, consumer: str = "g-test"):
        self.cfg = cfg
        self.keys = Keys(cfg.run.name)
        self.consumer = consumer
        self.pushed: list[str] = []

    async def open(self) -> None:
        self.redis = await aconnect(self.cfg.buffer.redis_url, retry_s=120)
        self.outbox = GroupOutbox(self.redis, self.keys, self.consumer, self.cfg.buffer.lease_timeout_s,
                                  poll_s=0.05)
        await self.outbox.connect(timeout_s=30)
        self.watch = asyncio.create_task(self.outbox.run())

    async def lease_and_push(self, num: int, num_tokens: int = 3) -> list[str]:
        done = []
        while len(done) < num:
            reply = await self.redis.xreadgroup(PROMPT_GROUP, self.consumer, {self.keys.prompts: ">"},
                                                count=num - len(done), block=500)
            for entry_id, fields in reply[0][1] if reply else []:
                task = schema.decode(fields[b"data"], schema.PromptTask)
                frame = schema.encode(make_group(task.group_id, num_tokens=num_tokens, lease_id=entry_id.decode()))
                self.outbox.put(task.group_id, entry_id, frame)
                done.append(task.group_id)
        self.pushed += done
        return done

    async def drain(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.outbox) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not len(self.outbox)

    async def close(self) -> None:
        self.watch.cancel()
        self.outbox.close()
        await self.redis.aclose()


def stream_group_ids(client, keys: Keys) -> list[str]:
    return [schema.decode(f[b"data"], schema.TrajectoryGroup).group_id for _, f in client.xrange(keys.trajectories)]
