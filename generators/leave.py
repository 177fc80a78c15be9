"""A generator's way out: the drain after SIGTERM, the quick leave once the run is over, and the
bounded teardown.

Leaving (SIGTERM or SIGINT, Redis up or down): the process is gone within
`generator.drain_timeout_s` + LEAVE_MARGIN_S of the signal. In-flight groups get until
`drain_timeout_s`; what is unfinished then is cancelled and its prompts handed back; ingest
confirmations and the weight-group leave get what is left of the margin but LEAVE_RESERVE_S, which
is kept for the leave record in Redis and the engine's shutdown. Every Redis call on the way out is
bounded (EXIT_REDIS_S, and the leave deadline, asyncrl/launch/leaving.py): once Redis has not answered,
the remaining Redis steps are skipped and one line says what was left to the buffer's reclaimer
(leased prompts come back when their leases expire, buffer.lease_timeout_s). The exit code is 0
when the generator left by itself (in time, Redis up or down), 143 when the leave timer had to end
it, 1 after a failure.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from asyncrl.protocol import retry, schema
from generators.drain import hand_back

log = logging.getLogger("generators.main")  # the generator's records keep the one name they have always had

LEAVE_MARGIN_S = 15.0  # past generator.drain_timeout_s: hand-back, confirmations, weight group, engine shutdown
LEAVE_RESERVE_S = 8.0  # of the margin, kept for the leave record and the engine's shutdown (vLLM: up to ~5 s)
EXIT_REDIS_S = 2.0  # one Redis call on the way out; not answered by then, Redis counts as unreachable
# Cancelled helper tasks get this long to finish. One still running then is left behind (the outbox's
# loop has been seen to outlast 5 s after its cancel), so that Ctrl-C still ends a run within 5 s.
HELPERS_STOP_S = 2.0


class WayOut:
    """The leaving of generator `gen`, within `gen.leave_deadline` (time.monotonic())."""

    def __init__(self, gen):
        self.gen = gen
        self.redis_lost: str | None = None  # on the way out: the step at which Redis did not answer
        self.skipped: list[str] = []  # Redis steps of the way out skipped because of that

    async def watch_stop_key(self) -> None:
        """The `stop` key (the learner has finished) ends the lease loop, as a run that is over."""
        gen = self.gen
        while not gen.stopping.is_set():
            if await gen.redis.exists(gen.keys.stop):
                gen.run_over = True
                gen.stopping.set()
            await asyncio.sleep(0.5)

    def left_s(self, reserve_s: float = 0.0) -> float:
        """Seconds until the leave deadline less `reserve_s` (never negative)."""
        return max(self.gen.leave_deadline - reserve_s - time.monotonic(), 0.0)

    async def bounded(self, what: str, aw, limit_s: float = EXIT_REDIS_S, lost_on_timeout: bool = True):
        """One step of the way out that talks to Redis, ended at `limit_s` and at the leave deadline.
        A Redis error, or a timeout of a single call (`lost_on_timeout`), marks Redis unreachable:
        every later Redis step is skipped (a frozen redis-server would hold each for socket_timeout,
        a dead one for buffer.redis_retry_s), and so is this one when Redis was already lost."""
        if self.redis_lost is not None:
            aw.close()
            self.skipped.append(what)
            return None
        try:
            return await asyncio.wait_for(aw, timeout=min(limit_s, self.left_s()))
        except (TimeoutError, RedisError, OSError) as e:
            if lost_on_timeout or not isinstance(e, TimeoutError):
                self.redis_lost = f"{what}: {e!r}"
                self.skipped.append(what)
                retry.leave_by(time.monotonic())  # calls still retrying elsewhere give up now
            else:
                log.warning("generator %s: %s not done in time; leaving without it", self.gen.id, what)
            return None

    async def hand_back(self, why: str | None = None) -> None:
        """Cancels what is in flight and hands its prompts back (bounded); without Redis the leases
        are left to expire."""
        tasks = list(self.gen.inflight)
        if self.redis_lost is not None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.skipped.append("hand back")
            return
        await self.bounded("hand back", hand_back(self.gen, *([why] if why else [])), lost_on_timeout=True)

    async def announce_draining(self) -> None:
        """The heartbeat says "draining" from now on, which the learner reads as: leave this generator
        out of the next weight group. A weight update in progress keeps that state when it ends."""
        self.gen.state = "draining"
        await self.bounded("heartbeat", self.gen.heartbeat())

    async def drain(self) -> None:
        """The way out after the lease loop stopped, within the leave deadline."""
        gen = self.gen
        await self.announce_draining()
        if not gen.run_over and self.redis_lost is None:  # a whole run's teardown sets `stop` first
            gen.run_over = bool(await self.bounded("stop key", gen.redis.exists(gen.keys.stop)))
        if gen.run_over:
            await self._leave_finished_run()
            return
        # Draining (SIGTERM: a scale-down): no new leases; what is in flight finishes and is pushed.
        if gen.inflight:
            await asyncio.wait(gen.inflight, timeout=self.left_s(LEAVE_MARGIN_S))
        if gen.inflight:  # not done in time: hand their prompts back (generators/drain.py)
            await self.hand_back()
        if gen.outbox.held:
            budget = self.left_s(LEAVE_RESERVE_S)
            await self.bounded("ingest confirmations", gen.outbox.drain(timeout_s=budget), budget + 0.5,
                               lost_on_timeout=False)
            if gen.outbox.held and self.redis_lost is None:
                log.warning("generator %s leaves %d groups unconfirmed; their prompts will be reclaimed",
                            gen.id, len(gen.outbox))
        if gen.epoch >= 0:
            # Its own deadline, inside the bound: the wait ends between Redis calls, not by a cancel
            # landing inside one (a Redis call cancelled mid-flight was seen to hang the leave).
            limit_s = self.left_s(LEAVE_RESERVE_S)
            await self.bounded("weight group leave", self._leave_weight_group(max(limit_s - 1.0, 0.0)),
                               limit_s, lost_on_timeout=False)

    async def _leave_weight_group(self, limit_s: float) -> None:
        """A drained generator stays for broadcasts until the learner has re-formed the weight group
        without it (draining members are left out of the next epoch): leaving in the middle of a
        broadcast would fail that sync for the other members (their receive is atomic, so they keep
        their weights, but they wait for the next epoch). Bounded by weights.join_timeout_s: the
        learner drops a draining member at its next sync or fleet check, well within that."""
        gen = self.gen
        deadline = time.monotonic() + min(gen.cfg.weights.join_timeout_s, limit_s)
        while gen.epoch >= 0 and time.monotonic() < deadline and not await gen.redis.exists(gen.keys.stop):
            frame = await gen.redis.get(gen.keys.wgroup)
            if not frame or not any(m.startswith(f"{gen.id}.") for m in schema.decode(frame, schema.GroupEpoch).members):
                return
            await asyncio.sleep(0.1)
        if gen.epoch >= 0 and time.monotonic() >= deadline:
            log.warning("generator %s: weight group leave not done in time; leaving without it", gen.id)

    async def _leave_finished_run(self) -> None:
        """The learner has finished (it set `stop`) and the buffer leaves with it: nothing generated
        now will be trained. Leave at once instead of draining: in-flight groups are cancelled and
        their prompts handed back (as a drain does with what it could not finish), unconfirmed ones
        are left. Draining waited on in-flight groups (up to generator.drain_timeout_s) and on ingest
        confirmations from a buffer that is gone (up to 60 s), which outlasted the launcher's grace:
        the generator was killed (seen in benchmark runs)."""
        gen = self.gen
        in_flight, unconfirmed = len(gen.inflight), len(gen.outbox)
        if gen.inflight:  # their leases go back at once: a resumed run need not wait for the reclaimer
            await self.hand_back("the run is over")
        if in_flight or unconfirmed:
            log.info("generator %s: the run is over; leaving %d groups in flight and %d unconfirmed",
                     gen.id, in_flight, unconfirmed)

    async def close(self, helpers: list[asyncio.Task]) -> None:
        """The end of every way out, a failure's too: `helpers` and in-flight groups cancelled, the
        leave record written, sockets, reward threads, engine and Redis closed, each bounded."""
        gen = self.gen
        for t in [*helpers, *gen.inflight]:
            t.cancel()
        # Bounded: a helper inside a Redis call under retry may take a moment to see the cancel.
        pending = [*helpers, *gen.inflight]
        _, stuck = (await asyncio.wait(pending, timeout=min(HELPERS_STOP_S, max(self.left_s(), 0.5)))
                    if pending else ((), ()))
        if stuck:
            log.warning("generator %s: %d tasks did not stop in time; leaving anyway", gen.id, len(stuck))
        await self.bounded("leave record", self._goodbye())
        gen.outbox.close()
        gen.ctx.term()
        gen.rewards.shutdown()
        gen.engine.shutdown()
        try:
            await asyncio.wait_for(gen.redis.aclose(), timeout=1.0)
        except (TimeoutError, RedisError, OSError):
            pass
        if self.redis_lost is not None:
            log.warning("generator %s left without Redis (unreachable at %s): skipped %s; %d unconfirmed groups "
                        "and any leased prompts come back when their leases expire (buffer.lease_timeout_s=%.0f)",
                        gen.id, self.redis_lost, ", ".join(self.skipped), len(gen.outbox),
                        gen.cfg.buffer.lease_timeout_s)
        log.info("generator %s left: groups=%d tokens=%d baseline_tokens=%d", gen.id, gen.groups, gen.tokens,
                 gen.baseline_tokens)

    async def _goodbye(self) -> None:
        gen = self.gen
        async with gen.redis.pipeline(transaction=False) as pipe:
            pipe.delete(gen.keys.gen(gen.id))
            pipe.hdel(gen.keys.members, gen.id)  # a clean leave: status forgets it (asyncrl/protocol/members.py)
            pipe.xadd(gen.keys.events, {"kind": "generator_leave", "id": gen.id, "t": f"{time.time():.3f}"})
            await pipe.execute()
