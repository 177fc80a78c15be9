"""A generator's heartbeat: the `gen:{id}` hash (with a TTL) that the learner, the buffer and
`asyncrl status` read, and the generator's own stall check reported in it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time

from asyncrl.observe.metrics import FleetTokenRate
from asyncrl.observe.selfwatch import SelfWatch
from asyncrl.protocol import fleet, members, schema, security
from asyncrl.protocol.sampling import heartbeat_fields


class Heartbeat:
    """Writes the heartbeat of the generator `gen` (asyncrl/protocol/schema.py `Heartbeat`) from its
    counters and state; owns the token-rate window and the stall check."""

    def __init__(self, gen):
        self.gen = gen
        self._rate_window, self._rate = FleetTokenRate(start=gen.started), 0.0
        # Its own stall check (asyncrl/observe/selfwatch.py), reported in its heartbeat: no launcher needed.
        self.watch = SelfWatch(f"generator:{gen.id}", gen.cfg.run.stall_timeout_s)
        self._watched_groups = 0

    async def write(self) -> None:
        gen = self.gen
        now = time.monotonic()
        elapsed = max(now - gen.started, 1e-6)
        # tokens/s over the last 30 s (since start before that), not over one
        # heartbeat interval (the counter moves when a group finishes: most intervals would read 0)
        self._rate = self._rate_window.update({gen.id: gen.tokens}, now)
        await self._watch_progress()
        proof = ""
        if (token := security.run_token(gen.cfg)) is not None:  # the learner ignores generators without it
            proof = security.token_proof(token, gen.id)
        fields = schema.Heartbeat(
            id=gen.id, state=gen.state, version=gen.version, epoch=gen.epoch, workers=gen.engine.num_workers,
            tokens=gen.tokens, baseline_tokens=gen.baseline_tokens, groups=gen.groups, tokens_per_s=self._rate,
            idle_ratio=gen.idle_s / elapsed, idle_s=round(gen.idle_s, 3), reward_errors=gen.reward_errors,
            sync_s_total=gen.sync_s_total, last_pause_s=gen.last_pause_s, num_syncs=gen.num_syncs,
            **heartbeat_fields(gen.cfg.generator), checksums=list(gen.last_checksums), pid=os.getpid(),
            host=socket.gethostname(), node=fleet.node_id(), updated_at=time.time(), schema_version=schema.SCHEMA_VERSION,
            token_proof=proof, **self.watch.fields()).to_hash()
        key = gen.keys.gen(gen.id)
        async with gen.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, int(gen.cfg.generator.heartbeat_ttl_s))
            # Kept past the key's expiry (asyncrl/protocol/members.py): status names a frozen or dead member.
            outbox = getattr(gen, "outbox", None)
            pipe.hset(gen.keys.members, gen.id, members.summary(
                fields, getattr(outbox, "last_group", ""), getattr(outbox, "last_group_at", None)))
            await pipe.execute()
        if (exporter := getattr(gen, "exporter", None)) is not None:  # started in Generator.start()
            exporter.update(fields)

    async def loop(self) -> None:
        while True:
            await self.write()
            await asyncio.sleep(self.gen.cfg.generator.heartbeat_s)

    async def _watch_progress(self) -> None:
        """Progress is a group pushed; a wait past run.stall_timeout_s is reported once (log, event,
        heartbeat) with what it waits on, read from this generator's own state."""
        gen = self.gen
        if gen.groups != self._watched_groups:
            self._watched_groups = gen.groups
            if (done := self.watch.progress()) is not None:
                await gen.redis.xadd(gen.keys.events, {"kind": "stall_resolved", "role": done.role, "what": done.what,
                                                       "t": f"{time.time():.3f}"}, maxlen=10_000, approximate=True)
            return
        if gen.state in ("starting", "draining"):
            self.watch.hold()
            return
        if (stall := self.watch.check("no_group", self._wait_reason)) is not None:
            await gen.redis.xadd(gen.keys.events, {"kind": "stall", "role": stall.role, "what": stall.what,
                                                   "since_s": f"{stall.since_s:.1f}", "reason": stall.reason,
                                                   "source": "self", "t": f"{time.time():.3f}"},
                                 maxlen=10_000, approximate=True)

    def _wait_reason(self) -> str:
        gen = self.gen
        if gen.version < 0:
            return "waiting for weights: it holds no policy version until the learner's next broadcast reaches it"
        unconfirmed = len(getattr(gen, "outbox", ()) or ())
        if unconfirmed:
            return (f"waiting for the buffer: {unconfirmed} pushed groups not confirmed as ingested (is the buffer "
                    "up, or full?)")
        if gen.inflight:
            return f"waiting for the engine: {len(gen.inflight)} groups in generation, none finished"
        return "waiting for prompts: none to lease (the buffer released none: its admission budget waits on the learner)"
