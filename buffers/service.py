"""`asyncrl buffer`: stateless over Redis, so it can be killed and restarted mid-run.

Three duties in one loop, each a module of its own:
- ingest: ZMQ PULL -> decode + validate -> atomic dedupe + XADD to the trajectories stream
  (buffers/ingest.py; what is refused is counted and logged by buffers/refusals.py);
- prompt feed: releases prompt groups under the admission rule (staleness bounded by construction),
  and reclaim: prompts leased by a generator that died are re-released after
  `buffer.lease_timeout_s` (buffers/prompts.py);
- gauges: backpressure at `buffer.capacity`, the published counters, the stall check (buffers/gauges.py).
One wait serves them all: a frame, or a wake-up from the notify stream (buffers/wakeups.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis
import zmq

from asyncrl.config import Config
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect, log_event
from asyncrl.protocol.retry import RETRYABLE
from asyncrl.protocol.store import ensure_groups
from asyncrl.tasks.base import PromptRecord
from buffers.gauges import RCVHWM, Counters, Gauges
from buffers.ingest import Ingest
from buffers.prompts import RELEASE_BACKLOG_S, PromptFeed
from buffers.refusals import HANDSHAKE_FAILED, Refusals
from buffers.wakeups import Wakeups

log = logging.getLogger(__name__)

# Prompt release: at once on a `version` or `fleet` wake-up (asyncrl/protocol/notify.py), else re-checked this often;
# every RELEASE_BACKLOG_S while the prompt backlog held it back (generators drain that by leasing, unannounced).
RELEASE_FALLBACK_S = 0.5
# Counters published as buffer:{name} (plus buffer:reject:{reason}); they survive buffer restarts.
COUNTERS = ("frames", "bytes", "groups", "dedupes", "reclaims", "full_pauses", "full_ms", "auth_refused",
            "requeues")


def load_prompts(cfg: Config) -> list[PromptRecord]:
    """`data.task`'s training rows (asyncrl/tasks/registry.py)."""
    from asyncrl.tasks.registry import train_rows

    return train_rows(cfg)


def model_vocab_size(model_path: str) -> int | None:
    """`vocab_size` from a local Hugging Face folder's config.json (no transformers import); None when
    the folder is not here (a hub id, a buffer on another node): the learner checks it then."""
    import json
    from pathlib import Path

    try:
        cfg = json.loads((Path(model_path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
    return int(size) if isinstance(size, int) and size > 0 else None


class BufferService:
    def __init__(self, cfg: Config, client: redis.Redis | None = None):
        self.cfg = cfg
        self.keys = Keys(cfg.run.name)
        self.client = client or connect(cfg.buffer.redis_url, retry_s=cfg.buffer.redis_retry_s)
        self.rows = load_prompts(cfg)
        self.counters = Counters.fromkeys(COUNTERS, 0)  # exported from the first sample on
        self.instance = uuid.uuid4().hex
        self._stop = threading.Event()
        # The parts hold what they use, never the service: nothing refers back to it, so a service
        # dropped without `run` (a test's) is freed at once with its ZeroMQ context.
        self.refusals = Refusals(self.counters)
        self._open_socket()
        self.wakeups = Wakeups(self.sock)
        vocab = model_vocab_size(cfg.model_path)
        if vocab is None:
            log.warning("no model config at %s: token ids are not checked against the vocabulary here "
                        "(the learner still checks them)", cfg.model_path)
        self.limits = schema.RunLimits.from_config(cfg, vocab)
        self.intake = Ingest(cfg, self.client, self.keys, self.wakeups, self.rows, self.limits, self.counters,
                             self.refusals)
        self.prompts = PromptFeed(cfg, self.client, self.keys, self.rows, self.counters)
        self.gauges = Gauges(cfg, self.client, self.keys, self.counters, self.instance)

    def _open_socket(self) -> None:
        """The ingest socket: PULL, bound to buffer.bind_host, behind the run token or CURVE."""
        cfg = self.cfg
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.PULL)
        # The receive high-water mark is what pushes back on generators when we stop pulling.
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        # Transport cap well above max_frame_bytes: ZeroMQ silently disconnects a peer past it, so
        # frames a little over the limit must still arrive here to be counted as `too_large`.
        self.sock.setsockopt(zmq.MAXMSGSIZE, 4 * cfg.buffer.max_frame_bytes + 2**20)
        self.sock.setsockopt(zmq.LINGER, 0)
        from asyncrl.protocol.security import advertised_host, secure_server_socket

        # Run token (PLAIN) or CURVE with known client keys, before bind; refusals are logged and counted.
        self.auth = secure_server_socket(cfg, self._ctx, self.sock, on_refuse=self.refusals.zap_refused)
        # Refused handshakes, counted by the monitor (the ZAP handler sees only peers whose mechanism
        # matched: one with no credentials or the wrong server key never reaches it).
        self.auth_monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED) if self.auth is not None else None
        self.refusals.monitor = self.auth_monitor
        host = cfg.buffer.bind_host
        if cfg.buffer.ingest_port:
            self.sock.bind(f"tcp://{host}:{cfg.buffer.ingest_port}")
            port = cfg.buffer.ingest_port
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.ingest_addr = f"tcp://{advertised_host(host, cfg.deploy.advertise_host)}:{port}"

    # ---- set-up --------------------------------------------------------------------------------

    def setup(self) -> None:
        from asyncrl.protocol.identity import claim

        claim(self.client, self.keys, self.cfg, "buffer")  # a finished or foreign run of this name is refused
        ensure_groups(self.client, self.keys)
        self.client.hsetnx(self.keys.cursor, "epoch", 0)
        self.client.hsetnx(self.keys.cursor, "index", 0)
        self.client.hsetnx(self.keys.cursor, "released", 0)
        # Counters continue across buffer restarts (the process is stateless; its totals are not).
        for k, v in self.client.hgetall(self.keys.metrics).items():
            name = k.decode()
            if name.startswith("buffer:") and (name[7:] in COUNTERS or name.startswith("buffer:reject:")):
                self.counters[name[7:]] = int(float(v))
        # The instance id first, then the address: a generator that sees either change re-sends
        # every group it has not seen ingested (generators/outbox.py).
        self.client.set(self.keys.buffer_instance, self.instance)
        self.client.set(self.keys.ingest_addr, self.ingest_addr)
        log_event(self.client, self.keys, "buffer_start", addr=self.ingest_addr, instance=self.instance)
        from asyncrl.observe.exporter import start_exporter

        self.exporter = start_exporter(self.cfg, "buffer", client=self.client, keys=self.keys)  # /metrics
        self.gauges.exporter = self.exporter
        log.info("buffer up: ingest=%s instance=%s prompts=%d capacity=%d", self.ingest_addr, self.instance,
                 len(self.rows), self.cfg.buffer.capacity)

    def count(self, name: str, k: int = 1) -> None:
        self.counters.count(name, k)

    @property
    def notify(self):
        """The notify stream's reader (asyncrl/protocol/notify.py `NotifyPipe`), once `run` started it."""
        return self.wakeups.notify

    # ---- the parts: ingest, prompts, gauges ----------------------------------------------------

    def ingest(self, max_frames: int = 256, timeout_ms: int = 50) -> int:
        """Pulls, validates, dedupes and appends what is waiting; returns groups added (buffers/ingest.py)."""
        added = self.intake.pull(max_frames, timeout_ms)
        self.gauges.added(added)
        return added

    def check_run(self, group: schema.TrajectoryGroup) -> None:
        """Validation of one group against the run and the released ids (buffers/ingest.py); raises FrameError."""
        self.intake.check_run(group)

    def release_prompts(self) -> int:
        """Releases prompts up to the admission budget and the backlog cap; returns how many."""
        return self.prompts.release()

    def reclaim(self) -> int:
        return self.prompts.reclaim()

    def publish_metrics(self) -> None:
        self.gauges.publish()

    # ---- main loop -----------------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> None:
        self.setup()
        # The `version` wake-ups (learner steps, dropped groups) and the `fleet` ones (a generator's
        # held version moved) end the ingest poll (asyncrl/protocol/notify.py).
        self.wakeups.start(self.cfg.buffer.redis_url, self.keys)
        try:
            self._loop()
            self.publish_metrics()
        except RETRYABLE as e:
            if not self._stop.is_set():
                raise
            # Leaving during an outage (asyncrl/launch/leaving.py bounds the retries): frames taken off the
            # socket and not stored are still in the generators' outboxes, which re-send them.
            log.warning("buffer leaves with Redis unreachable (%s): last counters not published", e)
        self._close()

    def _loop(self) -> None:
        fallback_s = RELEASE_FALLBACK_S if self.notify is not None else RELEASE_BACKLOG_S
        last_release = last_reclaim = last_metrics = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            room = self.gauges.room()
            self.gauges.update_full(room)
            if now - last_metrics > 1.0:
                self.gauges.watch_progress(self.prompts.wait_reason)
                self.publish_metrics()
                last_metrics = now
                if self.client.exists(self.keys.stop):
                    break
            self.refusals.check_handshakes()
            if room > 0:
                self.ingest(max_frames=min(256, room))
            else:
                self.wakeups.poll(20, frames=False)
            backlog_bound = self.prompts.backlog_bound
            if self.wakeups.woken or now - last_release > (RELEASE_BACKLOG_S if backlog_bound else fallback_s):
                self.wakeups.woken = False
                self.release_prompts()
                last_release = now
            if now - last_reclaim > min(5.0, self.cfg.buffer.lease_timeout_s / 2):
                self.reclaim()
                last_reclaim = now

    def _close(self) -> None:
        self.wakeups.close()
        if self.auth_monitor is not None:
            self.sock.disable_monitor()
            self.auth_monitor.close(0)
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        self._ctx.term()
        log.info("buffer stopped")


def main(cfg: Config) -> None:
    from asyncrl.launch.leaving import Leaving

    service = BufferService(cfg)
    leaving = Leaving("buffer", "buffer.drain_timeout_s", cfg.buffer.drain_timeout_s, service.stop).install()
    service.run()
    leaving.cancel()
