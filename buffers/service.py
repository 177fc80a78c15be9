"""`asyncrl buffer`: stateless over Redis, so it can be killed and restarted mid-run.

Three duties in one loop:
- ingest: ZMQ PULL -> decode + validate -> atomic dedupe + XADD to the trajectories stream;
- prompt feed: releases prompt groups under the admission rule (staleness bounded by construction);
- reclaim: prompts leased by a generator that died are re-released after `buffer.lease_timeout_s`.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import redis
import zmq

from asyncrl.config import Config
from asyncrl.modes import admission_staleness
from asyncrl.protocol import schema, store
from asyncrl.protocol.fleet import admitted, read_fleet
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect, log_event
from asyncrl.protocol.notify import NotifyPipe, publish
from asyncrl.protocol.retry import RETRYABLE
from asyncrl.protocol.store import LEARNER_GROUP, dedupe_append, ensure_groups, group_lag, oldest_unacked_ms
from asyncrl.tasks.synthetic import PromptRecord, iter_epochs

log = logging.getLogger(__name__)

RECLAIMER = "buffer-reclaim"
RCVHWM = 256  # frames queued in our PULL socket before ZeroMQ stops taking more from generators
MAX_BATCH_BYTES = 32 * 2**20  # one Redis pipeline carries at most this much
# Prompt release: at once on a `version` or `fleet` wake-up (asyncrl/protocol/notify.py), else re-checked this often;
# every 50 ms while the prompt backlog held it back (generators drain that by leasing, unannounced).
RELEASE_FALLBACK_S = 0.5
RELEASE_BACKLOG_S = 0.05
# Counters published as buffer:{name} (plus buffer:reject:{reason}); they survive buffer restarts.
COUNTERS = ("frames", "bytes", "groups", "dedupes", "reclaims", "full_pauses", "full_ms", "auth_refused")
# Rejected frames: counted each, logged once per reason per this many seconds (a fuzzing or broken
# peer sent 14,344 in one run, one WARNING line each).
REJECT_LOG_S = 10.0
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A refused handshake on the ingest socket, by what the monitor reports: reason -> what it means.
REFUSALS = {
    "auth_no_credentials": "the peer offers another security mechanism (no CURVE key / run token, or the other one)",
    "auth_wrong_server_key": "the peer's CURVE handshake does not decrypt (wrong server key)",
    "auth_unknown_credentials": "unknown CURVE client key or wrong run token",
    # The peer hung up during the handshake: often one with no credentials that saw the mismatch first.
    "auth_handshake": "the handshake broke off",
}


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


def admission_budget(version: int, max_staleness: int, groups_per_step: int, dropped_groups: int) -> int:
    """How many prompt groups may have been released in total at learner `version`.

    The AReaL rule: a group released now is trained at the latest `max_staleness` versions later,
    because no more than (max_staleness + 1) steps' worth of groups is ever outstanding. Groups the
    learner dropped (stale, or zero-variance) are added back so the pipe never starves.
    """
    return (version + max_staleness + 1) * groups_per_step + dropped_groups


def admission_version(learner_version: int, fleet: dict, admit) -> int:
    """The version the admission budget counts from: the learner's, or the lowest held by a generator
    that takes prompts, whichever is lower.

    A prompt released now starts on the weights its generator holds, not the learner's: released at
    learner version v while a push of v is still on its way, it would start on v-1 and be two
    versions behind by the time the learner reaches it, and be dropped as stale. Counting from the
    generators' version releases the next batch's prompts only once the weights they start on have
    landed. Generators holding no version (joining, or after a failed sync), draining ones and ones
    without a valid run token are left out; with none left the learner's version counts."""
    held = [hb.version for hb in fleet.values() if hb.version >= 0 and hb.state != "draining" and admit(hb)]
    return min([learner_version, *held])


class BufferService:
    def __init__(self, cfg: Config, client: redis.Redis | None = None):
        self.cfg = cfg
        self.keys = Keys(cfg.run.name)
        self.client = client or connect(cfg.buffer.redis_url, retry_s=cfg.buffer.redis_retry_s)
        self.rows = load_prompts(cfg)
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)  # exported from the first sample on
        self.instance = uuid.uuid4().hex
        self._stop = threading.Event()
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
        self.auth = secure_server_socket(cfg, self._ctx, self.sock, on_refuse=self._zap_refused)
        # Refused handshakes, counted by the monitor (the ZAP handler sees only peers whose mechanism
        # matched: one with no credentials or the wrong server key never reaches it).
        self.auth_monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILED) if self.auth is not None else None
        host = cfg.buffer.bind_host
        if cfg.buffer.ingest_port:
            self.sock.bind(f"tcp://{host}:{cfg.buffer.ingest_port}")
            port = cfg.buffer.ingest_port
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.ingest_addr = f"tcp://{advertised_host(host, cfg.deploy.advertise_host)}:{port}"
        self._last_rates = (time.monotonic(), 0, 0)
        self._depth, self._depth_at = 0, 0.0  # undelivered groups, when last measured
        self.full = False
        self._full_since = 0.0
        self.notify = None  # NotifyPipe, started by run()
        self._woken = False  # a wake-up arrived: re-check the admission budget now
        self._backlog_bound = False  # the last release was held back by buffer.prompt_backlog
        vocab = model_vocab_size(cfg.model_path)
        if vocab is None:
            log.warning("no model config at %s: token ids are not checked against the vocabulary here "
                        "(the learner still checks them)", cfg.model_path)
        self.limits = schema.RunLimits.from_config(cfg, vocab)
        self._rows_of: dict[str, list[int]] = {}
        for i, row in enumerate(self.rows):
            self._rows_of.setdefault(row.prompt_id, []).append(i)
        self._positions: dict[int, list[int]] = {}  # epoch -> position of each row in that epoch's order
        self._cursor = (0, 0)  # (epoch, index) of the next release, as last read
        self._reject_logged: dict[str, float] = {}  # reason -> when last logged
        self._reject_unlogged: dict[str, int] = {}  # reason -> rejects since then
        from asyncrl.observe.selfwatch import SelfWatch

        # Its own stall check (asyncrl/observe/selfwatch.py), published with the metrics: no launcher needed.
        self.watch = SelfWatch("buffer", cfg.run.stall_timeout_s, self.client, self.keys)
        self._stored = 0  # groups stored or deduped when last looked: the buffer's progress

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
        log.info("buffer up: ingest=%s instance=%s prompts=%d capacity=%d", self.ingest_addr, self.instance,
                 len(self.rows), self.cfg.buffer.capacity)

    def count(self, name: str, k: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + k

    # ---- ingest --------------------------------------------------------------------------------

    def ingest(self, max_frames: int = 256, timeout_ms: int = 50) -> int:
        """Pulls what is waiting (up to `max_frames`), validates, dedupes and appends; returns groups added.

        Frames are taken off the socket only as far as they fit under capacity; once taken they are
        held here until Redis has them (the client retries a lost Redis), so none is dropped.
        """
        if max_frames <= 0 or not self._poll(timeout_ms):
            return 0
        frames = []
        nbytes = 0
        while len(frames) < max_frames and nbytes < MAX_BATCH_BYTES:
            try:
                frame = self.sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            frames.append(frame)
            nbytes += len(frame)
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
                self.reject(e, len(buf))
                continue
            valid.append(group.group_id)
            dedupe_append(pipe, self.keys, group.group_id, buf)
        added = 0
        if valid:
            for gid, ok in zip(valid, pipe.execute(), strict=True):
                if ok:
                    added += 1
                else:
                    self.count("dedupes")
                    log.info("duplicate group %s dropped", gid)
        self.count("groups", added)
        # Counted last: whenever `frames` shows a frame, its outcome (reject, group, dedupe) is counted too.
        self.count("frames", len(frames))
        self.count("bytes", nbytes)
        self._depth += added
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
        if epoch not in self._positions:
            from asyncrl.tasks.synthetic import epoch_order

            if len(self._positions) >= 4:  # a few epochs around the cursor; recomputed on a miss
                self._positions.pop(next(iter(self._positions)))
            inverse = [0] * len(self.rows)
            for pos, row in enumerate(epoch_order(len(self.rows), self.cfg.run.seed, epoch)):
                inverse[row] = pos
            self._positions[epoch] = inverse
        first = min(self._positions[epoch][r] for r in rows)
        for refresh in (False, True):  # the cached cursor first; re-read once before refusing
            if refresh:
                cur = self.client.hmget(self.keys.cursor, "epoch", "index")
                self._cursor = (int(cur[0] or 0), int(cur[1] or 0))
            if (epoch, first) < self._cursor:
                return
        raise schema.FrameError("unreleased_id", f"group {group.group_id!r} was never released by this run")

    def reject(self, error: schema.FrameError, nbytes: int) -> None:
        """Counts a refused frame under its reason, logged as `_log_reject` says."""
        self.count(f"reject:{error.reason}")
        self._log_reject(error.reason, f"rejected frame ({nbytes} bytes): {error}")

    def _log_reject(self, reason: str, what: str) -> None:
        """Logs the first of each reason, then at most once per REJECT_LOG_S with how many came since."""
        now = time.monotonic()
        last = self._reject_logged.get(reason)
        if last is not None and now - last < REJECT_LOG_S:
            self._reject_unlogged[reason] = self._reject_unlogged.get(reason, 0) + 1
            return
        more = self._reject_unlogged.pop(reason, 0)
        self._reject_logged[reason] = now
        since = f" (+{more} more since the last line)" if more else ""
        log.warning("%s%s; total %s=%d", what, since, reason, self.counters[f"reject:{reason}"])

    def _zap_refused(self, why: str) -> None:
        """The ZAP handler's refusals are counted by the monitor (HANDSHAKE_FAILED_AUTH); the status
        text is kept for the next log line of that reason."""
        self._zap_why = why

    def check_handshakes(self) -> int:
        """Counts the ingest socket's refused handshakes (`auth_refused`, and by reason); returns how many."""
        if self.auth_monitor is None:
            return 0
        from zmq.utils.monitor import parse_monitor_message

        num = 0
        while True:
            try:
                event = parse_monitor_message(self.auth_monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return num
            num += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason, detail = "auth_unknown_credentials", getattr(self, "_zap_why", "")
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                reason, detail = "auth_no_credentials", ""
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                reason, detail = "auth_wrong_server_key", ""
            else:
                reason, detail = "auth_handshake", f"{event['event'].name}, {event['value']}"
            self.count("auth_refused")
            self.count(f"reject:{reason}")
            detail = f" ({detail})" if detail else ""
            self._log_reject(reason, f"refused a ZeroMQ connection on {event['endpoint'].decode()}: "
                                     f"{REFUSALS[reason]}{detail}")

    def _poll(self, timeout_ms: int, frames: bool = True) -> bool:
        """Waits up to `timeout_ms` for a frame (when `frames`) or a wake-up; True if a frame is waiting.
        A wake-up ends the wait at once, so a learner step releases the next prompts with no tick to wait."""
        if self.notify is None:
            if frames:
                return bool(self.sock.poll(timeout_ms, zmq.POLLIN))
            time.sleep(timeout_ms / 1000)
            return False
        events = dict((self._poller if frames else self._wake_poller).poll(timeout_ms))
        if self.notify.fd in events and self.notify.drain():
            self._woken = True
        return self.sock in events

    def room(self) -> int:
        """Groups that may still be appended before the trajectory stream holds `capacity` undelivered."""
        now = time.monotonic()
        # Re-measure often when close to full (the learner may have read meanwhile), rarely otherwise.
        stale_after = 0.05 if self._depth >= self.cfg.buffer.capacity - RCVHWM else 0.5
        if now - self._depth_at > stale_after:
            self._depth, self._depth_at = self.depth(), now
        return self.cfg.buffer.capacity - self._depth

    def _update_full(self, room: int) -> None:
        # Backpressure: at capacity we stop pulling; ZMQ high-water marks then hold the generators'
        # sends (and their outboxes stop leasing), so nothing is dropped anywhere.
        full = room <= 0
        if full and not self.full:
            log.warning("trajectory buffer full (%d undelivered >= buffer.capacity %d): ingest paused",
                        self._depth, self.cfg.buffer.capacity)
            self.count("full_pauses")
            self._full_since = time.monotonic()
        elif self.full and not full:
            paused = time.monotonic() - self._full_since
            self.count("full_ms", int(paused * 1000))
            log.info("trajectory buffer has room again after %.1fs: ingest resumed", paused)
        self.full = full

    # ---- prompt feed ---------------------------------------------------------------------------

    def release_prompts(self) -> int:
        """Releases prompts up to the admission budget and the backlog cap; returns how many."""
        version = int(self.client.get(self.keys.version) or 0)
        dropped = int(self.client.hget(self.keys.learner, "dropped_groups") or 0)
        cursor = {k.decode(): int(v) for k, v in self.client.hgetall(self.keys.cursor).items()}
        # run.mode=sync: staleness 0, exactly learner.batch_groups prompts per version (asyncrl/modes.py).
        staleness, per_step = admission_staleness(self.cfg), self.cfg.learner.batch_groups
        budget = admission_budget(version, staleness, per_step, dropped)
        # The fleet can only lower the budget: read it only when the learner's would release some.
        # (sync: generators start a group only on the learner's version.)
        if self.cfg.run.mode != "sync" and budget > cursor["released"]:
            version = admission_version(version, read_fleet(self.client, self.keys),
                                        lambda hb: admitted(self.cfg, hb)[0])
            budget = admission_budget(version, staleness, per_step, dropped)
        backlog = group_lag(self.client, self.keys.prompts, PROMPT_GROUP)
        num = min(budget - cursor["released"], self.cfg.buffer.prompt_backlog - backlog)
        self._backlog_bound = self.cfg.buffer.prompt_backlog - backlog < budget - cursor["released"]
        if num <= 0:
            return 0
        it = iter_epochs(self.rows, self.cfg.run.seed, cursor["epoch"], cursor["index"])
        now = time.time()
        epoch, index = cursor["epoch"], cursor["index"]
        frames = []
        for _ in range(num):
            epoch, index, row = next(it)
            task = schema.PromptTask(schema_version=schema.SCHEMA_VERSION, group_id=f"{row.prompt_id}@e{epoch}",
                                     prompt_id=row.prompt_id, prompt=row.prompt, answer=row.answer,
                                     released_at=now)
            frames.append(schema.encode(task))
        index += 1
        if index >= len(self.rows):
            epoch, index = epoch + 1, 0
        # The cursor moves in the same script as the XADDs, and only if nobody moved it meanwhile:
        # a crash releases all of them or none, a retried call or a second buffer none twice.
        if not store.release_prompts(self.client, self.keys, cursor["released"], epoch, index, frames):
            log.warning("prompt cursor moved under us (another buffer instance?): release skipped")
            return 0
        publish(self.client, self.keys, "prompts")  # sync-mode generators read the prompt stream without blocking
        return num

    def reclaim(self) -> int:
        """Re-releases prompts whose lease expired (their generator died); same group_id, so dedupe holds."""
        min_idle_ms = int(self.cfg.buffer.lease_timeout_s * 1000)
        claimed = self.client.xautoclaim(self.keys.prompts, PROMPT_GROUP, RECLAIMER, min_idle_ms,
                                         start_id="0-0", count=100, justid=True)
        if not claimed:
            return 0
        num = store.requeue_prompts(self.client, self.keys, claimed)
        self.count("reclaims", num)
        log_event(self.client, self.keys, "reclaim", num=num)
        log.warning("reclaimed %d prompts whose lease expired", num)
        return num

    # ---- metrics -------------------------------------------------------------------------------

    def depth(self) -> int:
        return group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)

    def publish_metrics(self) -> None:
        now = time.monotonic()
        t0, groups0, bytes0 = self._last_rates
        dt = max(now - t0, 1e-6)
        groups, nbytes = self.counters.get("groups", 0), self.counters.get("bytes", 0)
        self._last_rates = (now, groups, nbytes)
        depth = self.depth()
        oldest_ms = oldest_unacked_ms(self.client, self.keys.trajectories, LEARNER_GROUP)
        server_s, server_us = self.client.time()
        oldest_age = 0.0 if oldest_ms is None else max(server_s + server_us / 1e6 - oldest_ms / 1000, 0.0)
        fields = {**self.counters, "depth": depth, "capacity": self.cfg.buffer.capacity, "full": int(self.full),
                  "groups_per_s": (groups - groups0) / dt, "bytes_per_s": (nbytes - bytes0) / dt,
                  "oldest_age_s": oldest_age, "stream_len": self.client.xlen(self.keys.trajectories),
                  "instance": self.instance, "updated_at": time.time()}
        self.client.hset(self.keys.metrics, mapping={f"buffer:{k}": v for k, v in
                                                     {**fields, **self.watch.fields()}.items()})
        if (exporter := getattr(self, "exporter", None)) is not None:  # started in setup()
            exporter.update(fields)

    # ---- own stall check -----------------------------------------------------------------------

    def _watch_progress(self) -> None:
        """Progress is a group stored (or a re-sent one deduped); the clock starts once a generator
        holds a version, before which nothing can arrive."""
        stored = self.counters.get("groups", 0) + self.counters.get("dedupes", 0)
        if stored != self._stored:
            self._stored = stored
            self.watch.progress()
            return
        if not self.watch.moved and not any(hb.version >= 0 for hb in read_fleet(self.client, self.keys).values()):
            self.watch.hold()  # nobody can generate yet: not waiting on anyone
            return
        self.watch.check("no_trajectory", self._wait_reason)

    def _wait_reason(self) -> str:
        """What the buffer waits on: the learner (the admission budget is spent) or the generators."""
        version = int(self.client.get(self.keys.version) or 0)
        dropped = int(self.client.hget(self.keys.learner, "dropped_groups") or 0)
        released = int(self.client.hget(self.keys.cursor, "released") or 0)
        budget = admission_budget(version, admission_staleness(self.cfg), self.cfg.learner.batch_groups, dropped)
        backlog = group_lag(self.client, self.keys.prompts, PROMPT_GROUP)
        leased = int(self.client.xpending(self.keys.prompts, PROMPT_GROUP)["pending"])
        fleet = read_fleet(self.client, self.keys)
        states = ", ".join(f"{g}={hb.state}@v{hb.version}" for g, hb in sorted(fleet.items())) or "none live"
        if backlog == 0 and leased == 0 and released >= budget:
            return (f"waiting for the learner: the admission budget is spent ({released} prompts released of "
                    f"{budget} at learner version {version}) and no prompt is out; generators: {states}")
        return (f"waiting for generators: no group arrived although {leased} prompts are leased and {backlog} "
                f"wait to be leased ({released} released, learner at version {version}); generators: {states}")

    # ---- main loop -----------------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def _start_notify(self) -> None:
        """The `version` wake-ups (learner steps, dropped groups) and the `fleet` ones (a generator's
        held version moved) end the ingest poll (asyncrl/protocol/notify.py)."""
        if not self.cfg.buffer.redis_url:  # a test's injected client: poll on the fallback tick alone
            return
        self.notify = NotifyPipe(self.cfg.buffer.redis_url, self.keys, ("version", "fleet")).start()
        self._poller, self._wake_poller = zmq.Poller(), zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        for p in (self._poller, self._wake_poller):
            p.register(self.notify.fd, zmq.POLLIN)

    def run(self) -> None:
        self.setup()
        self._start_notify()
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
            room = self.room()
            self._update_full(room)
            if now - last_metrics > 1.0:
                self._watch_progress()
                self.publish_metrics()
                last_metrics = now
                if self.client.exists(self.keys.stop):
                    break
            self.check_handshakes()
            if room > 0:
                self.ingest(max_frames=min(256, room))
            else:
                self._poll(20, frames=False)
            if self._woken or now - last_release > (RELEASE_BACKLOG_S if self._backlog_bound else fallback_s):
                self._woken = False
                self.release_prompts()
                last_release = now
            if now - last_reclaim > min(5.0, self.cfg.buffer.lease_timeout_s / 2):
                self.reclaim()
                last_reclaim = now

    def _close(self) -> None:
        if self.notify is not None:
            self.notify.close()
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
