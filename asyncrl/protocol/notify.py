"""Wake-ups between roles: the writer of state that others wait for appends a tiny entry to a
capped stream (`notify`), and each waiting process blocks on that stream (XREAD BLOCK on a
connection of its own) instead of polling the state every 50 ms.

Kinds: `version` (the learner's version or its `dropped_groups` moved: the admission budget),
`weights` (`wgroup` or `wsync` changed: a group epoch or a weight broadcast), `prompts` (the buffer
released prompts), `fleet` (a generator's heartbeat shows a new held version: the buffer's admission
counts from the lowest), and `held`, which a generator bumps locally when the version it holds changes.

Why a stream, not pub/sub: a pub/sub message sent while nobody listens (a reader reconnecting, a
redis-server restart) is gone; a stream entry stays, and the reader resumes after the last id it
saw. A notification only says "look again": every waiter re-reads the state itself (version,
wsync, ...) after each wake-up and, when none comes, after a bounded fallback period, so a lost
notification costs one fallback period, never correctness. After a lost connection the reader
reconnects with backoff, and on reconnecting wakes every waiter once (what happened meanwhile may
not be in the stream: a restarted Redis may have lost its tail).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from redis.exceptions import RedisError

from asyncrl.protocol.keys import Keys

log = logging.getLogger(__name__)

KINDS = ("version", "weights", "prompts", "held", "fleet")
MAXLEN = 256  # entries kept: readers only need what arrived since their last read
BLOCK_S = 1.0  # one XREAD blocks this long, then re-issues (keeps the connection checked)
RECONNECT_S = (0.05, 1.0)  # backoff after a lost connection: first wait, cap


def publish(client, keys: Keys, kind: str):
    """Appends a `kind` wake-up (client or pipeline; after the state change it announces). With an
    asyncio client, await what it returns."""
    assert kind in KINDS, kind
    return client.xadd(keys.notify, {"k": kind}, maxlen=MAXLEN, approximate=True)


def _client_kwargs() -> dict:
    from asyncrl.protocol.security import redis_password

    # No retries: a lost connection is handled here (reconnect, wake everyone), not inside redis-py.
    kwargs = {"socket_timeout": BLOCK_S + 10, "socket_connect_timeout": 5, "retry": None}
    if password := redis_password():
        kwargs["password"] = password
    return kwargs


def _tail_id(reply) -> bytes:
    return reply[0][0] if reply else b"0-0"


def _kinds_of(reply) -> tuple[bytes, list[str]]:
    """(last entry id, kinds) of an XREAD reply on the one notify stream."""
    last, kinds = None, []
    for _stream, entries in reply or ():
        for entry_id, fields in entries:
            last = entry_id
            kinds.append((fields.get(b"k") or b"").decode())
    return last, kinds


class AsyncNotifications:
    """A generator's reader of the notify stream (run `run()` as a task); waiters share it.

    `seen(kinds)` before checking a state, `wait(kinds, seen, timeout_s)` after finding it not
    ready: no wake-up between the two is lost.
    """

    def __init__(self, url: str, keys: Keys):
        self.url, self.keys = url, keys
        self.counts = dict.fromkeys(KINDS, 0)
        self._changed = asyncio.Event()
        self.reconnects = 0
        self.connected = asyncio.Event()  # set while the reader holds a connection (tests wait on it)

    def seen(self, kinds) -> int:
        return sum(self.counts[k] for k in kinds)

    def bump(self, *kinds: str) -> None:
        """Counts a wake-up of each kind (all kinds when none is named) and wakes the waiters."""
        for k in kinds or KINDS:
            self.counts[k] += 1
        self._changed.set()
        self._changed = asyncio.Event()  # waiters that already hold the old event are woken; new ones wait

    async def wait(self, kinds, since: int, timeout_s: float) -> bool:
        """True as soon as a `kinds` wake-up arrived after `since` (a `seen(kinds)` value); False after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.seen(kinds) == since:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return False
        return True

    async def run(self) -> None:
        import redis.asyncio as aioredis

        client, last, backoff = None, None, RECONNECT_S[0]
        try:
            while True:
                try:
                    if client is None:
                        client = aioredis.Redis.from_url(self.url, **_client_kwargs())
                        last = _tail_id(await client.xrevrange(self.keys.notify, count=1))
                        if self.reconnects:
                            log.info("notify stream reader reconnected (%d)", self.reconnects)
                            self.bump()  # a restarted Redis may have lost what was published meanwhile
                        backoff = RECONNECT_S[0]
                        self.connected.set()
                    reply = await client.xread({self.keys.notify: last}, count=MAXLEN, block=int(BLOCK_S * 1000))
                    new_last, kinds = _kinds_of(reply)
                    if new_last is not None:
                        last = new_last
                        self.bump(*(k for k in kinds if k in self.counts))
                except RedisError as e:  # lost connection (restart) or a bad reply: start over on a new one
                    # Waiters fall back to their periodic checks meanwhile.
                    log.warning("notify stream reader lost Redis (%s); reconnecting in %.2fs", e, backoff)
                    self.connected.clear()
                    if client is not None:
                        await client.aclose()
                    client, self.reconnects = None, self.reconnects + 1
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RECONNECT_S[1])
        finally:
            if client is not None:
                await client.aclose()


class NotifyPipe:
    """A thread that blocks on the notify stream and makes a pipe readable on each wake-up of
    `kinds`, so a loop that already polls (the buffer's ZeroMQ poller) wakes on it with no extra wait."""

    def __init__(self, url: str, keys: Keys, kinds):
        self.url, self.keys, self.kinds = url, keys, set(kinds)
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        self._stop = threading.Event()
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name="notify-pipe", daemon=True)

    def start(self) -> NotifyPipe:
        self._thread.start()
        return self

    def drain(self) -> bool:
        """Empties the pipe; True if anything was in it."""
        got = False
        try:
            while os.read(self.fd, 4096):
                got = True
        except BlockingIOError:
            pass
        return got

    def _wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:  # the pipe is full: the reader has wake-ups pending already
            pass

    def _run(self) -> None:
        import redis

        client, last, backoff = None, None, RECONNECT_S[0]
        while not self._stop.is_set():
            try:
                if client is None:
                    client = redis.Redis.from_url(self.url, **_client_kwargs())
                    last = _tail_id(client.xrevrange(self.keys.notify, count=1))
                    if self.reconnects:
                        log.info("notify stream reader reconnected (%d)", self.reconnects)
                        self._wake()
                    backoff = RECONNECT_S[0]
                reply = client.xread({self.keys.notify: last}, count=MAXLEN, block=int(BLOCK_S * 1000))
                new_last, kinds = _kinds_of(reply)
                if new_last is not None:
                    last = new_last
                    if self.kinds.intersection(kinds):
                        self._wake()
            except RedisError as e:  # lost connection (restart) or a bad reply: start over on a new one
                log.warning("notify stream reader lost Redis (%s); reconnecting in %.2fs", e, backoff)
                if client is not None:
                    client.close()
                client, self.reconnects = None, self.reconnects + 1
                self._stop.wait(backoff)
                backoff = min(backoff * 2, RECONNECT_S[1])
        if client is not None:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=BLOCK_S + 2)
        if not self._thread.is_alive():  # else it may still write: leave the fds to the process exit
            os.close(self.fd)
            os.close(self._w)
