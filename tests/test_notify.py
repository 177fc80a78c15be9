"""Wake-ups through the notify stream (asyncrl/protocol/notify.py): a waiter returns within milliseconds of
the learner's announcement (the old polls took 50 ms), keeps doing so after a redis-server restart,
and a state change that comes without a wake-up is still picked up at the fallback period."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, aconnect, connect
from asyncrl.protocol.notify import AsyncNotifications
from asyncrl.protocol.store import set_and_notify
from generators.main import Generator
from generators.weights import WEIGHTS_FALLBACK_S
from tests.buffer_support import buffer_cfg, start_thread, wait_for

POLL_PERIOD_S = 0.05  # a polling loop's period: the latency that a notification must beat


def assert_prompt(latencies: list[float]) -> None:
    """Faster than a 50 ms poll period would be (25 ms on average, 50 at worst): the median under half
    the period, three in four under the period. Unloaded, each is a few ms; a busy 2-core box adds
    scheduling delays to some."""
    assert statistics.median(latencies) < POLL_PERIOD_S / 2, latencies
    assert sorted(latencies)[len(latencies) * 3 // 4] < POLL_PERIOD_S, latencies


def _publish_later(url: str, keys: Keys, delay_s: float, key: str, value, kind: str,
                   ) -> tuple[list[float], threading.Thread]:
    """Publishes from another thread after `delay_s`; the list gets the monotonic time just before."""
    out: list[float] = []

    def go():
        client = connect(url)
        time.sleep(delay_s)
        out.append(time.monotonic())
        set_and_notify(client, keys, key, value, kind)
        client.close()

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return out, thread


async def _wake_latencies(notes: AsyncNotifications, url: str, keys: Keys, num: int) -> list[float]:
    latencies = []
    for i in range(num):
        seen = notes.seen(("weights",))
        sent, publisher = _publish_later(url, keys, 0.05, keys.wsync, f"v{i}", "weights")
        assert await notes.wait(("weights",), seen, 5.0), "no wake-up within 5 s"
        assert sent, "woken before anything was published"
        latencies.append(time.monotonic() - sent[0])
        # The waiter wakes on the stream entry, before the publisher has read its transaction's reply.
        # Killing Redis in that window (CI did) made the publisher's retry re-run the transaction after
        # the restart: a second wake-up that ended the next wait before its publish.
        await asyncio.to_thread(publisher.join, 10)
    return latencies


def test_waiter_wakes_at_once_and_after_a_redis_restart(tmp_path):
    server = LocalRedis(tmp_path / "redis", appendfsync="always").start()
    keys = Keys("nt")

    async def scenario():
        notes = AsyncNotifications(server.url, keys)
        reader = asyncio.create_task(notes.run())
        await asyncio.wait_for(notes.connected.wait(), 10)
        # Kinds are separate: a `prompts` wake-up does not end a wait for `weights`.
        seen = notes.seen(("weights",))
        set_and_notify(connect(server.url), keys, keys.version, 1, "prompts")
        assert not await notes.wait(("weights",), seen, 0.3)
        before = await _wake_latencies(notes, server.url, keys, 10)

        server.stop(kill=True)  # a waiter meanwhile just times out: its caller re-checks the state itself
        seen = notes.seen(("weights",))
        t0 = time.monotonic()
        assert not await notes.wait(("weights",), seen, 0.3)
        assert time.monotonic() - t0 < 1.0
        waiting = asyncio.create_task(notes.wait(("weights",), notes.seen(("weights",)), 30.0))
        server.start()  # same port, same AOF
        # On reconnecting the reader wakes every waiter once: what was published meanwhile may be lost.
        assert await asyncio.wait_for(waiting, 30)
        await asyncio.wait_for(notes.connected.wait(), 10)
        after = await _wake_latencies(notes, server.url, keys, 10)
        reader.cancel()
        return before, after, notes.reconnects

    try:
        before, after, reconnects = asyncio.run(scenario())
    finally:
        server.stop()
    assert reconnects >= 1
    assert_prompt(before)
    assert_prompt(after)


class _RecordingEngine:
    """Stands in for vLLM: records when the weights loop asks to join an epoch or to receive."""

    num_workers = 1

    def __init__(self):
        self.joined: list[float] = []
        self.updated: list[float] = []

    async def join(self, epoch_frame, generator_id, timeout_s):
        self.joined.append(time.monotonic())
        return True

    async def update_weights(self, ann_frame, mode, timeout_s):
        self.updated.append(time.monotonic())
        return {"checksums": [], "pause_s": 0.0}


def _epoch(n: int) -> bytes:
    return schema.encode(schema.GroupEpoch(schema_version=schema.SCHEMA_VERSION, epoch=n, addr="127.0.0.1", port=1,
                                           members=["g0.0"], backend="gloo", opened_at=time.time()))


def _announcement(version: int, epoch: int) -> bytes:
    return schema.encode(schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version, epoch=epoch,
                                                   buckets=[], announced_at=time.time()))


def test_generator_weights_loop_follows_the_learner_at_once(tmp_path, redis_server):
    """The generator's own weights loop (real Redis, a recording engine): it joins an epoch and starts
    receiving within milliseconds of the learner's publish; without a wake-up, within the fallback."""
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=gw")
    keys = Keys(cfg.run.name)
    url = redis_server.url
    engine = _RecordingEngine()

    async def scenario():
        gen = Generator(cfg, "g0", engine=engine)
        gen.redis = await aconnect(url)
        gen.notes = AsyncNotifications(url, keys)
        tasks = [asyncio.create_task(gen.notes.run()), asyncio.create_task(gen.weights_loop())]
        await asyncio.wait_for(gen.notes.connected.wait(), 10)
        await asyncio.sleep(0.2)
        delays = []
        for n in (1, 2, 3):
            sent, _ = _publish_later(url, keys, 0.05, keys.wgroup, _epoch(n), "weights")
            while len(engine.joined) < n:
                await asyncio.sleep(0.001)
            delays.append(engine.joined[-1] - sent[0])
            sent, _ = _publish_later(url, keys, 0.05, keys.wsync, _announcement(n, n), "weights")
            while len(engine.updated) < n:
                await asyncio.sleep(0.001)
            delays.append(engine.updated[-1] - sent[0])
        assert gen.version == 3
        # A writer that publishes no wake-up (or one that was lost): picked up at the fallback period.
        client = connect(url)
        t0 = time.monotonic()
        client.set(keys.wsync, _announcement(4, 3))
        while len(engine.updated) < 4:
            await asyncio.sleep(0.005)
        fallback = time.monotonic() - t0
        for t in tasks:
            t.cancel()
        await gen.redis.aclose()
        return delays, fallback

    delays, fallback = asyncio.run(scenario())
    assert_prompt(delays)
    assert fallback < WEIGHTS_FALLBACK_S + 0.3, fallback


def test_buffer_releases_the_next_batch_when_the_learner_steps(tmp_path, redis_server):
    """run.mode=sync buffer (a real BufferService thread): the next version's prompts are in the
    stream within milliseconds of the learner's version bump, and with no wake-up at the fallback."""
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=bw", "run.mode=sync", "learner.batch_groups=3")
    keys = Keys(cfg.run.name)
    client = connect(redis_server.url)
    svc, thread = start_thread(cfg)
    try:
        assert wait_for(lambda: client.xlen(keys.prompts) == 3, 10)
        assert wait_for(lambda: svc.notify is not None and svc.notify.fd is not None, 10)
        time.sleep(0.3)  # the reader thread is blocked in XREAD by now
        delays = []
        for v in range(1, 8):
            t0 = time.monotonic()
            set_and_notify(client, keys, keys.version, v, "version")
            while client.xlen(keys.prompts) < 3 * (v + 1):
                time.sleep(0.001)
            delays.append(time.monotonic() - t0)
            time.sleep(0.1)
        assert_prompt(delays)
        t0 = time.monotonic()
        client.set(keys.version, 8)  # no wake-up: the fallback re-check releases it
        assert wait_for(lambda: client.xlen(keys.prompts) == 27, 5, 0.005)
        assert time.monotonic() - t0 < 1.0
    finally:
        svc.stop()
        thread.join(10)
