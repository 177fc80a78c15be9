"""A generator's weight loads: it follows the learner's group epochs (`wgroup`) and weight
announcements (`wsync`), joins each epoch it is a member of, and takes part in every broadcast of
its epoch through its engine (`Engine.join`, `Engine.update_weights`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from asyncrl.protocol import notify, schema

log = logging.getLogger("generators.main")  # the generator's records keep the one name they have always had

# Waits end at once on a wake-up from the notify stream (asyncrl/protocol/notify.py); this bounds them, so a
# lost wake-up (Redis restart, a writer that does not publish one) costs at most this long.
WEIGHTS_FALLBACK_S = 0.5  # re-read wgroup/wsync
# Fault injection for tests: seconds a generator holds back before it takes part in each push, so that a
# push outlasts the learner's time between steps by a known margin (the overlap test makes pushes slow).
PUSH_DELAY_S = float(os.environ.get("ASYNCRL_FAULT_PUSH_DELAY_S", "0"))


class WeightFollower:
    def __init__(self, gen):
        self.gen = gen

    async def loop(self) -> None:
        """Follows the learner's group epochs and weight announcements: re-read at each `weights`
        wake-up (the learner publishes one with every wgroup/wsync change), else every WEIGHTS_FALLBACK_S."""
        gen = self.gen
        last_ann = None
        while True:
            seen = gen.notes.seen(("weights",))
            try:
                last_ann = await self.follow(last_ann)
            except Exception as e:  # a failed join/receive: hold no version until the next good sync
                log.error("generator %s weight sync failed: %r; waiting for the next epoch", gen.id, e)
                gen.version, gen.epoch = -1, -1
                await gen.redis.xadd(gen.keys.events, {"kind": "sync_failed", "id": gen.id, "error": repr(e),
                                                       "t": f"{time.time():.3f}"})
            await gen.notes.wait(("weights",), seen, WEIGHTS_FALLBACK_S)

    async def follow(self, last_ann):
        """One look at `wgroup` and `wsync`: joins a new epoch that names this generator, then loads an
        announcement of its epoch not taken yet. Returns the announcement now taken (`last_ann` if none)."""
        gen = self.gen
        epoch_frame, ann_frame = await gen.redis.mget(gen.keys.wgroup, gen.keys.wsync)  # one round trip
        if epoch_frame:
            ann_frame = await self._join(epoch_frame, ann_frame)
        if not ann_frame or gen.epoch < 0:
            return last_ann
        ann = schema.decode(ann_frame, schema.WeightAnnouncement)
        ident = (ann.epoch, ann.version, ann.announced_at)
        # Every announcement of our epoch is a broadcast we must take part in, even one of a version
        # we already hold: the learner's broadcast waits for all members.
        if ann.epoch != gen.epoch or ident == last_ann:
            return last_ann
        await self._load(ann, ann_frame)
        return ident

    async def _join(self, epoch_frame: bytes, ann_frame: bytes | None) -> bytes | None:
        """Joins the epoch in `epoch_frame` when it is newer and names us; returns the announcement to
        look at (read again after a join: it may have moved on meanwhile)."""
        gen = self.gen
        info = schema.decode(epoch_frame, schema.GroupEpoch)
        if info.epoch > gen.epoch and any(m.startswith(f"{gen.id}.") for m in info.members):
            t0 = time.monotonic()
            ok = await gen.engine.join(epoch_frame, gen.id, gen.cfg.weights.join_timeout_s)
            if ok:
                gen.epoch = info.epoch
            log.info("generator %s join epoch=%d ok=%s (%.2fs)", gen.id, info.epoch, ok, time.monotonic() - t0)
            ann_frame = await gen.redis.get(gen.keys.wsync)  # may have moved on while we joined
        return ann_frame

    async def _load(self, ann: schema.WeightAnnouncement, ann_frame: bytes) -> None:
        """Takes part in the broadcast of `ann`; the heartbeat says `syncing` meanwhile."""
        gen, w = self.gen, self.gen.cfg.weights
        prev, gen.state = gen.state, "syncing"
        await gen.heartbeat()
        if PUSH_DELAY_S > 0:
            await asyncio.sleep(PUSH_DELAY_S)
        stats = await gen.engine.update_weights(ann_frame, w.mode, w.sync_timeout_s)
        gen.version = ann.version
        gen.notes.bump("held")  # sync mode's lease loop waits for this
        gen.last_checksums = stats["checksums"]
        gen.sync_s_total += stats["pause_s"]
        gen.last_pause_s, gen.num_syncs = stats["pause_s"], gen.num_syncs + 1
        await gen.redis.xadd(gen.keys.events, {"kind": "generator_sync", "id": gen.id, "version": ann.version,
                                               "mode": w.mode, "pause_s": f"{stats['pause_s']:.4f}",
                                               "wake_s": f"{stats.get('wake_s', 0.0):.4f}",
                                               "t": f"{time.time():.3f}"}, maxlen=10_000, approximate=True)
        if gen.state == "syncing":  # a drain that began during the update keeps "draining"
            gen.state = prev if prev in ("draining", "generating") else "generating"
        await gen.heartbeat()
        await notify.publish(gen.redis, gen.keys, "fleet")  # the buffer's admission counts from it
        self._log_load(stats)

    def _log_load(self, stats: dict) -> None:
        gen = self.gen
        ipc = (f"; ipc handle {stats['handle_s']:.3f}s, checksums {stats['checksum_s']:.3f}s, "
               f"confirm {stats['finish_s']:.3f}s" if stats.get("handle_s") else "")
        log.info("generator %s now at version %d (pause %.3fs: to pause %.3fs, load %.3fs by %s%s; transfer before "
                 "it %.3fs; wake %.3fs)", gen.id, gen.version, stats["pause_s"], stats.get("wait_s", 0.0),
                 stats.get("load_s", stats.get("receive_s", 0.0)), stats.get("load_path", "reload"), ipc,
                 stats.get("stage_s", 0.0),
                 stats.get("wake_s", 0.0))
