"""The buffer's one wait: frames on the ingest socket, or a wake-up from the notify stream
(asyncrl/protocol/notify.py: `version`, a learner step or dropped groups; `fleet`, a generator's held
version moved), which ends the wait at once so the next prompts go out with no tick to wait.
"""

from __future__ import annotations

import time

import zmq

from asyncrl.protocol.keys import Keys
from asyncrl.protocol.notify import NotifyPipe


class Wakeups:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.notify: NotifyPipe | None = None  # started by `start`
        self.woken = False  # a wake-up arrived: re-check the admission budget now

    def start(self, redis_url: str, keys: Keys) -> None:
        if not redis_url:  # a test's injected client: poll on the fallback tick alone
            return
        self.notify = NotifyPipe(redis_url, keys, ("version", "fleet")).start()
        self._poller, self._wake_poller = zmq.Poller(), zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        for p in (self._poller, self._wake_poller):
            p.register(self.notify.fd, zmq.POLLIN)

    def poll(self, timeout_ms: int, frames: bool = True) -> bool:
        """Waits up to `timeout_ms` for a frame (when `frames`) or a wake-up; True if a frame is waiting.
        A wake-up ends the wait at once, so a learner step releases the next prompts with no tick to wait."""
        if self.notify is None:
            if frames:
                return bool(self.sock.poll(timeout_ms, zmq.POLLIN))
            time.sleep(timeout_ms / 1000)
            return False
        events = dict((self._poller if frames else self._wake_poller).poll(timeout_ms))
        if self.notify.fd in events and self.notify.drain():
            self.woken = True
        return self.sock in events

    def close(self) -> None:
        if self.notify is not None:
            self.notify.close()
