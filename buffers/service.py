"""`asyncrl buffer`: stateless over Redis, so it can be killed and restarted mid-run.

Three duties in one loop:
- ingest: ZMQ PULL -> decode + validate -> atomic dedupe + XADD to the trajectories stream;
- prompt feed: releases prompt groups under the admission rule (staleness bounded by construction);
- reclaim: prompts leased by a generator that died are re-released after `buffer.lease_timeout_s`.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import redis
import zmq

from asyncrl import schema
from asyncrl.config import Config
from asyncrl.keys import PROMPT_GROUP, Keys, connect, log_event
from asyncrl.tasks import PromptRecord, copy_dataset, iter_epochs
from asyncrl.store import DEDUPE_APPEND, LEARNER_GROUP, SEEN_TTL_S, ensure_groups, group_lag

log = logging.getLogger(__name__)

RECLAIMER = "buffer-reclaim"


def load_prompts(cfg: Config) -> list[PromptRecord]:
    if cfg.data.task == "copy":
        return copy_dataset(cfg.data.num_prompts, seed=cfg.run.seed, alphabet=cfg.data.alphabet,
                            min_len=cfg.data.min_len, max_len=cfg.data.max_len)
    if cfg.data.task in ("gsm8k", "prompts"):
        from asyncrl.data import load_dataset_from_config

        return load_dataset_from_config(cfg.data)
    raise AssertionError(cfg.data.task)


def admission_budget(version: int, max_staleness: int, groups_per_step: int, dropped_groups: int) -> int:
    """How many prompt groups may have been released in total at learner `version`.

    The AReaL rule: a group released now is trained at the latest `max_staleness` versions later,
    because no more than (max_staleness + 1) steps' worth of groups is ever outstanding. Groups the
    learner dropped (stale, or zero-variance) are added back so the pipe never starves.
    """
    return (version + max_staleness + 1) * groups_per_step + dropped_groups


class BufferService:
    def __init__(self, cfg: Config, client: redis.Redis | None = None):
        self.cfg = cfg
        self.keys = Keys(cfg.run.name)
        self.client = client or connect(cfg.buffer.redis_url)
        self.rows = load_prompts(cfg)
        self.counters: dict[str, int] = {}
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.PULL)
        # The receive high-water mark is what pushes back on generators when we stop pulling.
        self.sock.setsockopt(zmq.RCVHWM, 256)
        self.sock.setsockopt(zmq.MAXMSGSIZE, cfg.buffer.max_frame_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        host = cfg.buffer.bind_host
        if cfg.buffer.ingest_port:
            self.sock.bind(f"tcp://{host}:{cfg.buffer.ingest_port}")
            port = cfg.buffer.ingest_port
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.ingest_addr = f"tcp://{host}:{port}"
        self._dedupe = self.client.register_script(DEDUPE_APPEND)
        self._last_rates = (time.monotonic(), 0, 0)

    # ---- set-up --------------------------------------------------------------------------------

    def setup(self) -> None:
        ensure_groups(self.client, self.keys)
        self.client.hsetnx(self.keys.cursor, "epoch", 0)
        self.client.hsetnx(self.keys.cursor, "index", 0)
        self.client.hsetnx(self.keys.cursor, "released", 0)
        self.client.set(self.keys.ingest_addr, self.ingest_addr)
        log_event(self.client, self.keys, "buffer_start", addr=self.ingest_addr)
        log.info("buffer up: ingest=%s prompts=%d", self.ingest_addr, len(self.rows))
        from asyncrl.exporter import start_exporter

        self.exporter = start_exporter(self.cfg, "buffer", client=self.client, keys=self.keys)

    def count(self, name: str, k: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + k

    # ---- ingest --------------------------------------------------------------------------------

    def ingest(self, max_frames: int = 256, timeout_ms: int = 50) -> int:
        """Pulls what is waiting (up to `max_frames`), validates, dedupes and appends; returns groups added."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        frames = []
        while len(frames) < max_frames:
            try:
                frames.append(self.sock.recv(zmq.NOBLOCK, copy=True))
            except zmq.Again:
                break
        pipe = self.client.pipeline(transaction=False)
        valid = []
        for frame in frames:
            self.count("frames")
            self.count("bytes", len(frame))
            try:
                group = schema.decode(frame, schema.TrajectoryGroup, self.cfg.buffer.max_frame_bytes)
                schema.validate_group(group, max_tokens=self.cfg.generator.max_tokens)
            except schema.FrameError as e:
                self.count(f"reject:{e.reason}")
                log.warning("rejected frame (%d bytes): %s", len(frame), e)
                continue
            valid.append(group.group_id)
            self._dedupe(keys=[self.keys.seen(group.group_id), self.keys.trajectories],
                         args=[frame, SEEN_TTL_S], client=pipe)
        added = 0
        if valid:
            for gid, ok in zip(valid, pipe.execute(), strict=True):
                if ok:
                    added += 1
                else:
                    self.count("dedupes")
                    log.info("duplicate group %s dropped", gid)
        self.count("groups", added)
        return added

    # ---- prompt feed ---------------------------------------------------------------------------

    def release_prompts(self) -> int:
        """Releases prompts up to the admission budget and the backlog cap; returns how many."""
        version = int(self.client.get(self.keys.version) or 0)
        dropped = int(self.client.hget(self.keys.learner, "dropped_groups") or 0)
        cursor = {k.decode(): int(v) for k, v in self.client.hgetall(self.keys.cursor).items()}
        budget = admission_budget(version, self.cfg.algorithm.max_staleness, self.cfg.learner.batch_groups, dropped)
        backlog = group_lag(self.client, self.keys.prompts, PROMPT_GROUP)
        num = min(budget - cursor["released"], self.cfg.buffer.prompt_backlog - backlog)
        if num <= 0:
            return 0
        it = iter_epochs(self.rows, self.cfg.run.seed, cursor["epoch"], cursor["index"])
        pipe = self.client.pipeline(transaction=True)
        now = time.time()
        epoch, index = cursor["epoch"], cursor["index"]
        for _ in range(num):
            epoch, index, row = next(it)
            task = schema.PromptTask(schema_version=schema.SCHEMA_VERSION, group_id=f"{row.prompt_id}@e{epoch}",
                                     prompt_id=row.prompt_id, prompt=row.prompt, answer=row.answer,
                                     released_at=now)
            pipe.xadd(self.keys.prompts, {"data": schema.encode(task)})
        index += 1
        if index >= len(self.rows):
            epoch, index = epoch + 1, 0
        # The cursor moves in the same transaction as the XADDs: a crash releases all of them or none.
        pipe.hset(self.keys.cursor, mapping={"epoch": epoch, "index": index, "released": cursor["released"] + num})
        pipe.execute()
        return num

    def reclaim(self) -> int:
        """Re-releases prompts whose lease expired (their generator died); same group_id, so dedupe holds."""
        min_idle_ms = int(self.cfg.buffer.lease_timeout_s * 1000)
        reply = self.client.xautoclaim(self.keys.prompts, PROMPT_GROUP, RECLAIMER, min_idle_ms,
                                       start_id="0-0", count=100)
        claimed = reply[1]
        if not claimed:
            return 0
        pipe = self.client.pipeline(transaction=True)
        for entry_id, fields in claimed:
            if fields is None:  # deleted meanwhile
                pipe.xack(self.keys.prompts, PROMPT_GROUP, entry_id)
                continue
            pipe.xadd(self.keys.prompts, fields)
            pipe.xack(self.keys.prompts, PROMPT_GROUP, entry_id)
            pipe.xdel(self.keys.prompts, entry_id)
        pipe.execute()
        self.count("reclaims", len(claimed))
        log_event(self.client, self.keys, "reclaim", num=len(claimed))
        log.warning("reclaimed %d prompts whose lease expired", len(claimed))
        return len(claimed)

    # ---- metrics -------------------------------------------------------------------------------

    def depth(self) -> int:
        return group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)

    def publish_metrics(self) -> None:
        now = time.monotonic()
        t0, groups0, bytes0 = self._last_rates
        dt = max(now - t0, 1e-6)
        groups, nbytes = self.counters.get("groups", 0), self.counters.get("bytes", 0)
        self._last_rates = (now, groups, nbytes)
        fields = {**self.counters, "depth": self.depth(), "groups_per_s": (groups - groups0) / dt,
                  "bytes_per_s": (nbytes - bytes0) / dt, "updated_at": time.time()}
        self.client.hset(self.keys.metrics, mapping={f"buffer:{k}": v for k, v in fields.items()})
        if (exporter := getattr(self, "exporter", None)) is not None:  # started in setup()
            from asyncrl.metrics import oldest_undelivered_age_s

            exporter.update({**fields, "oldest_age_s": oldest_undelivered_age_s(self.client, self.keys)})

    # ---- main loop -----------------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> None:
        self.setup()
        last_release = last_reclaim = last_metrics = 0.0
        full = False
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_metrics > 1.0:
                depth = self.depth()
                # Backpressure: past capacity we stop pulling; ZMQ high-water marks then hold the
                # generators' sends, so nothing is dropped anywhere.
                if depth >= self.cfg.buffer.capacity and not full:
                    log.warning("trajectory buffer full (%d >= capacity %d): ingest paused", depth,
                                self.cfg.buffer.capacity)
                    self.count("full_pauses")
                full = depth >= self.cfg.buffer.capacity
                self.publish_metrics()
                last_metrics = now
                if self.client.exists(self.keys.stop):
                    break
            if not full:
                self.ingest()
            else:
                time.sleep(0.05)
            if now - last_release > 0.05:
                self.release_prompts()
                last_release = now
            if now - last_reclaim > min(5.0, self.cfg.buffer.lease_timeout_s / 2):
                self.reclaim()
                last_reclaim = now
        self.publish_metrics()
        self.sock.close(0)
        self._ctx.term()
        log.info("buffer stopped")


def main(cfg: Config) -> None:
    service = BufferService(cfg)
    signal.signal(signal.SIGTERM, service.stop)
    signal.signal(signal.SIGINT, service.stop)
    service.run()
