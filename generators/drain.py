"""Leaving on SIGTERM: what is in flight finishes and is pushed; what cannot finish in time is handed back.

Why hand back rather than just exit: an abandoned lease would sit until `buffer.lease_timeout_s`
expires before another generator may take the prompt. Handing it back re-queues it at once, with the
same atomic script the buffer's reclaimer uses (asyncrl/protocol/store.py RECLAIM_REQUEUE: XACK + re-XADD +
XDEL), so a prompt is never both handed back and pushed twice: a late push dedupes on its group_id.
"""

from __future__ import annotations

import asyncio
import logging
import time

from asyncrl.protocol.keys import PROMPT_GROUP
from asyncrl.protocol.store import RECLAIM_REQUEUE

log = logging.getLogger(__name__)


async def leased_not_pushed(gen) -> list[bytes]:
    """Prompt entries this generator holds a lease on whose group is not waiting in the outbox."""
    pending = await gen.redis.xpending_range(gen.keys.prompts, PROMPT_GROUP, min="-", max="+", count=100_000,
                                             consumername=gen.id)
    in_outbox = {h.entry_id for h in gen.outbox.held.values()}
    return [p["message_id"] for p in pending if p["message_id"] not in in_outbox]


async def hand_back(gen, why: str = "it could not finish in generator.drain_timeout_s") -> int:
    """Cancels the in-flight groups and re-queues their prompts; returns how many were handed back."""
    tasks = list(gen.inflight)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    ids = await leased_not_pushed(gen)
    num = int(await gen.redis.eval(RECLAIM_REQUEUE, 1, gen.keys.prompts, PROMPT_GROUP, *ids)) if ids else 0
    await gen.redis.xadd(gen.keys.events, {"kind": "hand_back", "id": gen.id, "num": num,
                                           "t": f"{time.time():.3f}"}, maxlen=10_000, approximate=True)
    log.warning("generator %s handed back %d leased prompts: %s", gen.id, num, why)
    return num
