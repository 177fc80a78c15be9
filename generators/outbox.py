"""A generator's outbox: groups pushed to the buffer but not yet seen ingested.

Why: a group handed to ZeroMQ is not yet safe. If the buffer dies (kill -9) the frames queued in
its socket die with it, and a generator that had already acked the prompt would have lost that
group for good. So the prompt's lease travels in the frame and the buffer acks it in the step that
stores the group (asyncrl/protocol/store.py); the frame is forgotten here once the group's dedupe key
`seen:{group_id}` exists, or once its lease is gone. Until then the frame is kept here; when the buffer comes back
(new `buffer_instance`, or a new `ingest_addr` when buffer.ingest_port=0) the PUSH socket is
rebuilt and every unconfirmed frame is sent again — dedupe makes a re-send of an ingested group a
no-op. While a frame waits (buffer full: backpressure) its prompt lease is renewed, so the buffer
does not hand the prompt to another generator. Held groups count against
generator.max_concurrent_groups, so a full buffer stops the generator leasing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from asyncrl.protocol.keys import PROMPT_GROUP, Keys

log = logging.getLogger(__name__)

SNDHWM = 64  # frames queued towards the buffer before sends wait (backpressure)


@dataclass
class _Held:
    entry_id: bytes  # the prompt's entry in the prompts stream, acked once the group is ingested
    frame: bytes
    pushed_at: float
    renewed_at: float


class GroupOutbox:
    def __init__(self, redis, keys: Keys, consumer: str, lease_timeout_s: float, poll_s: float = 0.1,
                 ctx: zmq.asyncio.Context | None = None, secure=None, on_refused=None):
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.lease_timeout_s = lease_timeout_s
        self.poll_s = poll_s
        self.ctx = ctx or zmq.asyncio.Context()
        # secure(sock): run token / CURVE credentials (asyncrl/protocol/security.py); on_refused(error): the
        # buffer refused them, which ZeroMQ alone would only show as sends that never arrive.
        self.secure, self.on_refused = secure, on_refused
        self._auth_watch: asyncio.Task | None = None
        self._auth_mon = None  # the monitor socket: closed synchronously, or ctx.term() would hang
        self.held: dict[str, _Held] = {}
        self.sock: zmq.asyncio.Socket | None = None
        self.addr: bytes | None = None
        self.instance: bytes | None = None
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._sender: asyncio.Task | None = None
        self.num_confirmed = 0
        self.num_resent = 0
        self.num_reconnects = 0
        self.num_given_up = 0
        self.num_lease_gone = 0  # held groups whose lease was gone at renewal (stored, or reclaimed)
        self.last_group, self.last_group_at = "", None  # the newest group handed over (wall clock)

    def __len__(self) -> int:
        return len(self.held)

    # ---- connection ------------------------------------------------------------------------------

    async def connect(self, timeout_s: float = 300.0) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            addr, instance = await self.redis.mget(self.keys.ingest_addr, self.keys.buffer_instance)
            if addr:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout_s}s for the buffer's ingest address ({self.keys.ingest_addr}); "
                                   "is `asyncrl buffer` running?")
            await asyncio.sleep(0.2)
        self._reconnect(addr, instance)
        return addr.decode()

    def _reconnect(self, addr: bytes, instance: bytes | None) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self.sock is not None:
            self.sock.close(linger=0)  # what it still queues went to a dead buffer; re-sent below
            self.num_reconnects += 1
        self.sock = self.ctx.socket(zmq.PUSH)
        # Send high-water mark: when the buffer stops pulling, sends wait here (backpressure).
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        if self.secure is not None and self.secure(self.sock):  # credentials set: watch for a refusal
            self._watch_auth(self.sock)
        self.sock.connect(addr.decode())
        if self.addr is not None:
            log.warning("buffer restarted (ingest %s -> %s, instance %s -> %s): re-sending %d unconfirmed groups",
                        self.addr.decode(), addr.decode(), self.instance, instance, len(self.held))
            self.num_resent += len(self.held)
        self.addr, self.instance = addr, instance
        self._queue = asyncio.Queue()
        for gid in self.held:
            self._queue.put_nowait(gid)
        self._sender = asyncio.create_task(self._send_loop(self.sock, self._queue))

    def _watch_auth(self, sock) -> None:
        from asyncrl.protocol.security import auth_monitor, watch_auth

        self._stop_auth_watch()
        self._auth_mon = auth_monitor(sock)

        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None and self.on_refused is not None:
                self.on_refused(task.exception())

        self._auth_watch = asyncio.create_task(watch_auth(self._auth_mon, f"generator {self.consumer}"))
        self._auth_watch.add_done_callback(done)

    def _stop_auth_watch(self) -> None:
        if self._auth_watch is not None:
            self._auth_watch.cancel()
            self._auth_watch = None
        if self._auth_mon is not None:
            self._auth_mon.close(0)
            self._auth_mon = None

    async def _send_loop(self, sock: zmq.asyncio.Socket, queue: asyncio.Queue) -> None:
        while True:
            gid = await queue.get()
            held = self.held.get(gid)
            if held is not None:
                await sock.send(held.frame, copy=False)

    # ---- groups ----------------------------------------------------------------------------------

    def put(self, group_id: str, entry_id: bytes, frame: bytes) -> None:
        """Hands a finished group over; its prompt is acked once the buffer has ingested it."""
        now = time.monotonic()
        self.held[group_id] = _Held(entry_id, frame, now, now)
        self.last_group, self.last_group_at = group_id, time.time()
        self._queue.put_nowait(group_id)

    async def check(self) -> int:
        """One round: follow buffer restarts, ack what got ingested, renew leases; returns groups confirmed."""
        addr, instance = await self.redis.mget(self.keys.ingest_addr, self.keys.buffer_instance)
        if addr and (addr != self.addr or instance != self.instance):
            self._reconnect(addr, instance)
        if not self.held:
            return 0
        gids = list(self.held)
        async with self.redis.pipeline(transaction=False) as pipe:
            for gid in gids:
                pipe.exists(self.keys.seen(gid))
            seen = await pipe.execute()
        done = [gid for gid, s in zip(gids, seen, strict=True) if s]
        if done:
            await self.redis.xack(self.keys.prompts, PROMPT_GROUP, *[self.held[g].entry_id for g in done])
            for gid in done:
                del self.held[gid]
            self.num_confirmed += len(done)
        await self._renew_or_give_up()
        return len(done)

    async def _renew_or_give_up(self) -> None:
        now = time.monotonic()
        renew = [h for h in self.held.values() if now - h.renewed_at > self.lease_timeout_s / 3]
        if not renew:
            return
        full = await self.redis.hget(self.keys.metrics, "buffer:full")
        for gid, h in list(self.held.items()):
            if h not in renew:
                continue
            if now - h.pushed_at > self.lease_timeout_s and full != b"1":
                # The buffer has room but never took it (it rejected the frame?): leave the prompt's
                # lease to expire, so the buffer re-releases it, rather than hold it for ever.
                log.error("group %s not ingested %.0fs after its push although the buffer has room; "
                          "leaving its prompt to be reclaimed", gid, now - h.pushed_at)
                del self.held[gid]
                self.num_given_up += 1
                continue
            # XCLAIM to ourselves resets the entry's idle time: the lease is renewed.
            if not await self.redis.xclaim(self.keys.prompts, PROMPT_GROUP, self.consumer, 0, [h.entry_id],
                                           justid=True):
                # No lease left to renew: the buffer stored the group (and acked the lease; its `seen:` key
                # may have expired while we were frozen) or reclaimed the prompt for someone else. Either
                # way the buffer would refuse this copy now: nothing is lost by letting it go.
                log.info("group %s: its prompt's lease is gone (stored, or reclaimed): dropped from the outbox", gid)
                del self.held[gid]
                self.num_lease_gone += 1
                continue
            h.renewed_at = now

    async def run(self) -> None:
        """Checks every poll_s until cancelled. The redis-py 8 asyncio client can swallow a cancel that
        lands inside a command (the call returns, the task goes on with `cancelling()` set): measured,
        up to a third of cancels in the first seconds of a client, and the loop then ran on for good,
        so a generator's way out waited its helpers' bound for it. Hence the check after every round."""
        task = asyncio.current_task()
        while True:
            await self.check()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            await asyncio.sleep(self.poll_s)

    async def drain(self, timeout_s: float) -> bool:
        """Waits until every held group is confirmed (or `timeout_s`); True when none is left."""
        deadline = time.monotonic() + timeout_s
        while self.held and time.monotonic() < deadline:
            await self.check()
            await asyncio.sleep(self.poll_s)
        return not self.held

    def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        self._stop_auth_watch()
        if self.sock is not None:
            self.sock.close(linger=0)
