"""The outbox's loop ends at once when cancelled, whenever the cancel lands (inside a Redis command
too, where the redis-py asyncio client can swallow it). Real redis-server, the real GroupOutbox."""

import asyncio
import random
import time

from asyncrl.protocol.keys import PROMPT_GROUP, Keys, aconnect, connect
from asyncrl.protocol.store import ensure_groups
from generators.outbox import GroupOutbox


def test_a_cancelled_outbox_loop_ends_within_a_second_every_time(redis_server):
    client, keys = connect(redis_server.url), Keys("outbox-cancel")
    ensure_groups(client, keys)
    client.set(keys.ingest_addr, b"tcp://127.0.0.1:1")
    client.hset(keys.metrics, "buffer:full", 1)  # held groups are renewed every round, never given up
    for _ in range(4):
        client.xadd(keys.prompts, {"data": b"p"})
    leases = [e for e, _ in client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=4)[0][1]]
    rng = random.Random(0)

    async def go() -> list[float]:
        r = await aconnect(redis_server.url)
        box = GroupOutbox(r, keys, "g0", lease_timeout_s=0.03, poll_s=0.001)
        await box.connect(timeout_s=5)
        for i, lease in enumerate(leases):
            box.put(f"p{i}@e0", lease, b"frame")
        late = []
        for _ in range(150):
            task = asyncio.create_task(box.run())
            await asyncio.sleep(rng.uniform(0.001, 0.02))
            t0 = time.monotonic()
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=1.0)
            if not done:
                late.append(time.monotonic() - t0)
                task.cancel()
                await asyncio.wait([task], timeout=5)
        box.close()
        await r.aclose()
        return late

    late = asyncio.run(go())
    assert late == [], f"{len(late)} of 150 cancels not done within 1 s"
