"""A scale-down's SIGTERM that lands while a weight update is in progress: the generator's heartbeat
must go on saying "draining" once the update ends, since that is what makes the learner re-form the
weight group without it (a drained generator waits for that before it leaves). A real Redis; the
engine is a stand-in whose load is held open until the drain has begun."""

from __future__ import annotations

import asyncio
import time

from asyncrl.config import load_config
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, aconnect
from asyncrl.protocol.notify import AsyncNotifications
from generators.main import Generator


class HeldLoad:
    """The Engine calls `_follow_weights` makes, with a load that lasts until `release` is set."""

    num_workers = 1

    def __init__(self):
        self.loading, self.release = asyncio.Event(), asyncio.Event()

    async def join(self, epoch_frame: bytes, generator_id: str, timeout_s: float) -> bool:
        return True

    async def update_weights(self, announcement_frame: bytes, mode: str, timeout_s: float) -> dict:
        self.loading.set()
        await self.release.wait()
        return {"pause_s": 0.01, "checksums": []}


def test_a_drain_that_begins_during_a_weight_update_stays_draining(redis_server):
    cfg = load_config(None, [f"buffer.redis_url={redis_server.url}", "run.name=drain-state",
                             "logging.prometheus=false"])
    keys = Keys(cfg.run.name)

    async def scenario():
        engine = HeldLoad()
        gen = Generator(cfg, "g0", engine=engine)
        gen.redis = await aconnect(redis_server.url)
        gen.notes = AsyncNotifications(redis_server.url, keys)  # its reader is not needed here
        gen.leave_deadline = time.monotonic() + 30
        epoch = schema.GroupEpoch(schema_version=schema.SCHEMA_VERSION, epoch=1, addr="127.0.0.1", port=1,
                                  members=["g0.0"], backend="gloo", opened_at=time.time())
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=1, epoch=1, buckets=[],
                                        announced_at=time.time())
        await gen.redis.mset({keys.wgroup: schema.encode(epoch), keys.wsync: schema.encode(ann)})
        gen.state = "generating"
        follow = asyncio.create_task(gen._follow_weights(None))
        await asyncio.wait_for(engine.loading.wait(), 10)
        assert (await gen.redis.hget(keys.gen("g0"), "state")).decode() == "syncing"
        await gen._announce_draining()  # the SIGTERM's way out begins mid-update
        engine.release.set()
        await asyncio.wait_for(follow, 10)
        state = (await gen.redis.hget(keys.gen("g0"), "state")).decode()
        await gen.redis.aclose()
        return gen.version, gen.state, state

    version, state, published = asyncio.run(scenario())
    assert version == 1, "the update itself completed"
    assert state == published == "draining"
