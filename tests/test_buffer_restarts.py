"""Restarts mid-run with real data through the real `asyncrl buffer` process: redis-server killed and
restarted, the buffer killed (-9) and restarted. Nothing lost, nothing duplicated."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.launch.redis_server import LocalRedis, free_port
from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect
from asyncrl.protocol.store import group_pending
from tests.buffer_support import BufferProcess, LeasingPusher, buffer_cfg, stream_group_ids, wait_for
from tests.helpers import make_group

ADMIT = ["learner.batch_groups=32", "algorithm.max_staleness=3"]  # 128 prompts may be released


def _assert_exactly_once(client, keys, pushed):
    ids = stream_group_ids(client, keys)
    assert len(ids) == len(set(ids)), "a group landed twice"
    assert set(ids) == set(pushed), (sorted(set(pushed) - set(ids)), sorted(set(ids) - set(pushed)))
    assert group_pending(client, keys.prompts, PROMPT_GROUP) == 0, "every prompt is acked once ingested"


def test_redis_kill9_and_restart_mid_run_loses_and_duplicates_nothing(tmp_path):
    server = LocalRedis(tmp_path / "redis", appendfsync="always").start()
    cfg = buffer_cfg(tmp_path, server, "run.name=rr", *ADMIT)
    keys = Keys("rr")
    client = connect(server.url, retry_s=60)
    buf = BufferProcess(cfg, tmp_path).start(client, keys)

    async def scenario():
        pusher = LeasingPusher(cfg)
        await pusher.open()
        await pusher.lease_and_push(20)
        assert await pusher.drain(20)
        server.stop(kill=True)  # SIGKILL, mid-run: buffer and pusher now retry with backoff
        await asyncio.sleep(1.5)
        server.start()  # same port, same AOF
        await pusher.lease_and_push(20)
        assert await pusher.drain(30), f"{len(pusher.outbox)} groups never confirmed"
        await pusher.close()
        return pusher.pushed

    try:
        pushed = asyncio.run(scenario())
        assert buf.alive(), "the buffer must ride out a Redis restart"
        _assert_exactly_once(client, keys, pushed)
        assert len(pushed) == 40
        log = (tmp_path / "buffer.log").read_text()
        assert "REDIS UNREACHABLE" in log and "redis is back" in log, "the outage is logged loudly"
    finally:
        buf.stop()
        server.stop()


def test_redis_restart_while_groups_are_in_flight(tmp_path):
    """Groups pushed while Redis is down reach it once it is back (the buffer holds what it pulled)."""
    server = LocalRedis(tmp_path / "redis", appendfsync="always").start()
    cfg = buffer_cfg(tmp_path, server, "run.name=rf", *ADMIT)
    keys = Keys("rf")
    client = connect(server.url, retry_s=60)
    buf = BufferProcess(cfg, tmp_path).start(client, keys)

    async def scenario():
        pusher = LeasingPusher(cfg)
        await pusher.open()
        reply = await pusher.redis.xreadgroup(PROMPT_GROUP, pusher.consumer, {keys.prompts: ">"}, count=30,
                                              block=2000)
        leased = reply[0][1]
        server.stop(kill=True)
        for entry_id, fields in leased:  # finished while Redis is down: pushed straight away
            gid = schema.decode(fields[b"data"], schema.PromptTask).group_id
            pusher.outbox.put(gid, entry_id, schema.encode(make_group(gid)))
            pusher.pushed.append(gid)
        await asyncio.sleep(2.0)
        server.start()
        assert await pusher.drain(30), f"{len(pusher.outbox)} groups never confirmed"
        await pusher.close()
        return pusher.pushed

    try:
        pushed = asyncio.run(scenario())
        assert len(pushed) == 30
        assert buf.alive()
        _assert_exactly_once(client, keys, pushed)
    finally:
        buf.stop()
        server.stop()


@pytest.mark.parametrize("fixed_port", [False, True], ids=["new-port", "same-port"])
def test_buffer_kill9_and_restart_mid_run_loses_nothing(tmp_path, redis_server, fixed_port):
    port = ["buffer.ingest_port=" + str(free_port())] if fixed_port else []
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=br", *ADMIT, *port)
    keys = Keys("br")
    client = connect(redis_server.url)
    buf = BufferProcess(cfg, tmp_path).start(client, keys)

    async def scenario():
        pusher = LeasingPusher(cfg)
        await pusher.open()
        await pusher.lease_and_push(15)
        buf.kill()  # whatever it had pulled but not written, and its socket queue, die with it
        addr0 = client.get(keys.ingest_addr)
        # Finished while no buffer runs: sent towards the dead socket, held by the outbox.
        await pusher.lease_and_push(15)
        await asyncio.sleep(0.5)
        assert len(pusher.outbox) >= 15, "nothing can be confirmed while the buffer is down"
        buf.start(client, keys)
        assert (client.get(keys.ingest_addr) != addr0) is not fixed_port
        assert await pusher.drain(30), f"{len(pusher.outbox)} groups never confirmed"
        await pusher.lease_and_push(10)
        assert await pusher.drain(30)
        assert pusher.outbox.num_reconnects >= 1 and pusher.outbox.num_resent >= 15
        await pusher.close()
        return pusher.pushed

    try:
        pushed = asyncio.run(scenario())
        assert len(pushed) == 40
        _assert_exactly_once(client, keys, pushed)
        # Counters survive the restart: the second instance continued the first one's totals.
        assert wait_for(lambda: int(client.hget(keys.metrics, "buffer:groups") or 0) == 40, 5)
    finally:
        buf.stop()
