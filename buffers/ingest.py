"""The buffer's ingest: frames pulled off the ZeroMQ PULL socket, decoded and validated against the
run (and against what this buffer released), deduplicated and appended to the trajectories stream
in one pipeline (one Lua script per group, asyncrl/protocol/store.py `dedupe_append`).
"""

from __future__ import annotations

import logging

import zmq

from asyncrl.config import Config
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys
from asyncrl.protocol.store import dedupe_append, seen_ttl_s
from asyncrl.tasks.base import PromptRecord
from buffers.gauges import Counters
from buffers.refusals import Refusals
from buffers.wakeups import Wakeups

log = logging.getLogger("buffers.service")  # the buffer's records keep the one name they have always had

MAX_BATCH_BYTES = 32 * 2**20  # one Redis pipeline carries at most this much


class Ingest:
    """Frames from the ingest socket (`wakeups.sock`) into the trajectories stream of the run's Redis
    `client`, checked against `limits` and the released ids of `rows`."""

    def __init__(self, cfg: Config, client, keys: Keys, wakeups: Wakeups, rows: list[PromptRecord],
                 limits: schema.RunLimits, counters: Counters, refusals: Refusals):
        self.cfg, self.client, self.keys, self.wakeups = cfg, client, keys, wakeups
        self.rows, self.limits, self.counters, self.refusals = rows, limits, counters, refusals
        self._rows_of: dict[str, list[int]] = {}
        for i, row in enumerate(rows):
            self._rows_of.setdefault(row.prompt_id, []).append(i)
        self._positions: dict[int, list[int]] = {}  # epoch -> position of each row in that epoch's order
        self._cursor = (0, 0)  # (epoch, index) of the next release, as last read
        self._seen_ttl_s = seen_ttl_s(cfg.buffer.lease_timeout_s, cfg.buffer.redis_retry_s)

    def pull(self, max_frames: int = 256, timeout_ms: int = 50) -> int:
        """Pulls what is waiting (up to `max_frames`), validates, dedupes and appends; returns groups added.

        Frames are taken off the socket only as far as they fit under capacity; once taken they are
        held here until Redis has them (the client retries a lost Redis), so none is dropped.
        """
        if max_frames <= 0 or not self.wakeups.poll(timeout_ms):
            return 0
        frames = []
        nbytes = 0
        while len(frames) < max_frames and nbytes < MAX_BATCH_BYTES:
            try:
                frame = self.wakeups.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames.append(frame)
            nbytes += len(frame)
        added = self._append(frames)
        self.counters.count("groups", added)
        # Counted last: whenever `frames` shows a frame, its outcome (reject, group, dedupe) is counted too.
        self.counters.count("frames", len(frames))
        self.counters.count("bytes", nbytes)
        return added

    def _append(self, frames: list) -> int:
        """Validates `frames` and appends the valid ones not seen before; returns how many were added."""
        pipe = self.client.pipeline(transaction=False)
        valid = []
        # An episode's tokens are bounded by env.max_tokens, a single completion's by generator.max_tokens.
        max_bytes, max_tokens = self.cfg.buffer.max_frame_bytes, self.limits.max_tokens
        for frame in frames:
            buf = frame.buffer
            try:
                group = schema.decode(buf, schema.TrajectoryGroup, max_bytes, max_tokens=max_tokens)
                self.check_run(group)
            except schema.FrameError as e:
                self.refusals.reject(e, len(buf))
                continue
            valid.append((group.group_id, len(buf)))
            dedupe_append(pipe, self.keys, group.group_id, buf, group.lease_id, self._seen_ttl_s)
        added = 0
        if valid:
            for (gid, nbytes), ok in zip(valid, pipe.execute(), strict=True):
                if ok == 1:
                    added += 1
                elif ok == 0:
                    self.counters.count("dedupes")
                    log.info("duplicate group %s dropped", gid)
                else:  # its prompt was stored from another copy, or reclaimed and re-released since
                    self.refusals.reject(schema.FrameError("lease_gone", f"group {gid!r}: its prompt's lease "
                                                           "no longer exists (stored, or reclaimed)"), nbytes)
        return added

    def check_run(self, group: schema.TrajectoryGroup) -> None:
        """Validation against the run (token ids, sampling, lengths: schema.validate_for_run) and
        against what this buffer released: a group id it never handed out (`{prompt_id}@e{epoch}`,
        the prompt at a position of that epoch's order the cursor has passed) is not a group the
        admission rule counted, so it could not be trained honestly. Raises FrameError."""
        schema.validate_for_run(group, self.limits)
        if not self.cfg.buffer.check_released:
            return
        prompt_id, epoch = schema.split_group_id(group.group_id)  # validate_for_run checked the form
        rows = self._rows_of.get(prompt_id)
        if rows is None:
            raise schema.FrameError("unknown_prompt", f"prompt id {prompt_id!r} is not in this run's data")
        first = min(self._epoch_positions(epoch)[r] for r in rows)
        for refresh in (False, True):  # the cached cursor first; re-read once before refusing
            if refresh:
                cur = self.client.hmget(self.keys.cursor, "epoch", "index")
                self._cursor = (int(cur[0] or 0), int(cur[1] or 0))
            if (epoch, first) < self._cursor:
                return
        raise schema.FrameError("unreleased_id", f"group {group.group_id!r} was never released by this run")

    def _epoch_positions(self, epoch: int) -> list[int]:
        """The position of each row in `epoch`'s release order (a few epochs cached, recomputed on a miss)."""
        if epoch not in self._positions:
            from asyncrl.tasks.base import epoch_order

            if len(self._positions) >= 4:  # a few epochs around the cursor; recomputed on a miss
                self._positions.pop(next(iter(self._positions)))
            inverse = [0] * len(self.rows)
            for pos, row in enumerate(epoch_order(len(self.rows), self.cfg.run.seed, epoch)):
                inverse[row] = pos
            self._positions[epoch] = inverse
        return self._positions[epoch]
