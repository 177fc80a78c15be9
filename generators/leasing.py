"""A generator's lease loop: prompts leased from the `prompts` stream (group `generators`) up to
`generator.max_concurrent_groups` in flight, eval tasks first (generators/evaluation.py), each
started as a task of its own; in run.mode=sync only while the generator holds the learner's version.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from asyncrl.modes import may_generate
from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP

log = logging.getLogger("generators.main")  # the generator's records keep the one name they have always had

# Waits end at once on a wake-up from the notify stream (asyncrl/protocol/notify.py); these bound them, so a
# lost wake-up (Redis restart, a writer that does not publish one) costs at most this long.
VERSION_FALLBACK_S = 0.5  # run.mode=sync: re-read the learner's version
PROMPTS_FALLBACK_S = 0.1  # run.mode=sync: re-read the prompt stream (and the eval stream with it)


class Leaser:
    def __init__(self, gen):
        self.gen = gen
        self.failure: BaseException | None = None  # of a group task: ends the lease loop with it

    async def until_stopped(self) -> None:
        """The lease loop, until `stopping`: it sees that at its next turn (a lease read blocks at
        most 200 ms); one held in a Redis call under retry (Redis down) is cancelled after a second.
        A prompt leased by a cancelled read is handed back with the rest (generators/drain.py)."""
        lease = asyncio.create_task(self.loop())
        stop = asyncio.create_task(self.gen.stopping.wait())
        try:
            await asyncio.wait({lease, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not lease.done():
                await asyncio.wait({lease}, timeout=1.0)
        finally:
            stop.cancel()
            if not lease.done():
                lease.cancel()
            await asyncio.gather(lease, stop, return_exceptions=True)
        if lease.cancelled() or lease.exception() is None:
            return
        if self.gen.stopping.is_set() and isinstance(lease.exception(), (RedisError, OSError)):
            return  # Redis was down while leaving: the way out handles that
        raise lease.exception()

    async def loop(self) -> None:
        gen = self.gen
        self.failure = None
        cap = gen.cfg.generator.max_concurrent_groups
        while not gen.stopping.is_set():
            if self.failure is not None:
                raise self.failure
            if gen.version < 0:
                gen.state = "waiting_weights"
                t0, seen = time.monotonic(), gen.notes.seen(("held",))
                await gen.notes.wait(("held",), seen, 0.1)
                gen.idle_s += time.monotonic() - t0
                continue
            if gen.cfg.run.mode == "sync" and not await self._lockstep_turn():
                continue
            if gen.state != "syncing":
                gen.state = "generating"
            # Groups waiting in the outbox for ingest confirmation no longer use the engine; they count
            # only past `cap` of them, so a stalled or full buffer still stops leasing (backpressure).
            free = cap - len(gen.inflight) - max(0, len(gen.outbox) - cap)
            if free <= 0:
                await asyncio.sleep(0.01)
                continue
            free -= await gen.evals.lease(free)  # eval tasks have priority over training prompts
            if free <= 0:
                continue
            await self._lease(free)

    async def _lease(self, free: int) -> None:
        """One read of up to `free` prompts, each started as a group task."""
        gen = self.gen
        t0 = time.monotonic()
        # run.mode=sync reads without blocking: a blocked read would lease the next version's prompts
        # before this generator holds its weights (they would wait in process(), uncounted as idle).
        # Instead it waits for a wake-up (prompts released, the learner stepped) and re-checks the version.
        lockstep = gen.cfg.run.mode == "sync"
        seen = gen.notes.seen(("prompts", "version", "held"))
        reply = await gen.redis.xreadgroup(PROMPT_GROUP, gen.id, {gen.keys.prompts: ">"}, count=free,
                                           block=None if lockstep else 200)
        if not reply:
            if lockstep:
                await self._idle_if_done()  # this batch is done here: the learner steps next
                await gen.notes.wait(("prompts", "version", "held"), seen, PROMPTS_FALLBACK_S)
            if not gen.inflight:
                gen.idle_s += time.monotonic() - t0
            return
        for entry_id, fields in reply[0][1]:
            try:
                task = schema.decode(fields[b"data"], schema.PromptTask)
            except (schema.FrameError, KeyError) as e:
                log.error("bad prompt entry %s: %s", entry_id, e)
                await gen.redis.xack(gen.keys.prompts, PROMPT_GROUP, entry_id)
                continue
            t = asyncio.create_task(gen.process(entry_id, task))
            gen.inflight.add(t)
            t.add_done_callback(self.done)

    def done(self, task: asyncio.Task) -> None:
        """A group task's end: out of the in-flight set; its failure ends the lease loop."""
        self.gen.inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("group failed: %r", task.exception())
            self.failure = task.exception()

    async def wait_for_turn(self) -> None:
        """run.mode=sync: a prompt leased just before the learner's version moved waits for its weights."""
        gen = self.gen
        while gen.cfg.run.mode == "sync":
            seen = gen.notes.seen(("version", "held"))
            if may_generate("sync", gen.version, await self._learner_version()):
                break
            await gen.notes.wait(("version", "held"), seen, VERSION_FALLBACK_S)

    async def _idle_if_done(self) -> None:
        """run.mode=sync: tells the engine it idles (generator.sleep) once nothing is in flight and the
        outbox has handed every group to the buffer."""
        gen = self.gen
        if not gen.inflight and not len(gen.outbox):
            await gen.engine.idle()

    async def _learner_version(self) -> int:
        return int(await self.gen.redis.get(self.gen.keys.version) or 0)

    async def _lockstep_turn(self) -> bool:
        """run.mode=sync: lease only while holding the learner's current version (asyncrl/modes.py)."""
        gen = self.gen
        seen = gen.notes.seen(("version", "held"))
        if may_generate("sync", gen.version, await self._learner_version()):
            return True
        t0 = time.monotonic()
        gen.state = "waiting_weights"
        await self._idle_if_done()
        await gen.notes.wait(("version", "held"), seen, VERSION_FALLBACK_S)
        if not gen.inflight:
            gen.idle_s += time.monotonic() - t0
        return False
