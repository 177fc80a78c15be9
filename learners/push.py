"""The learner's weight pushes, off its critical path: every rank takes part in the gathers, rank 0
opens the weight-group epochs, sends, and checks what the generators report holding (`Pusher`).

A push is staged on the learner's thread: the weights are gathered and copied into one of the
sender's two flat buffers (`WeightSender.stage`). The send (announcement, broadcast or ipc handles,
the members' confirmation) runs on a thread of its own, while the learner goes on with its next step.
At most one send is in flight: the next version is staged into the other buffer meanwhile, and its
send starts only once the previous one has returned, so members see every announcement in order and
a buffer is written again only after every member has it. With `weights.overlap=false`, or at
staleness 0, the learner waits for each send at once.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from asyncrl.config import Config, ConfigError
from asyncrl.observe import timeline
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, log_event
from asyncrl.protocol.store import set_and_notify
from asyncrl.protocol.transports import TRANSPORTS
from asyncrl.protocol.weight_sync import (
    WeightSender,
    checksum_mode,
    choose_backend,
    pack_buckets,
    plan_buckets,
    to_dtype,
)
from learners.fleet import Fleet
from learners.setup import Parts

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had


@dataclass
class Push:
    version: int
    future: Future
    started_at: float = field(default_factory=time.time)


@dataclass
class PushResult:
    version: int
    sums: list[int] | None  # None: it failed
    error: str
    started_at: float  # wall time: submitted
    done_at: float  # wall time: the members had it (or it failed)
    waited_s: float  # how long the learner waited for it


class PushQueue:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncrl-push")
        self.inflight: Push | None = None
        self.next_slot = 0

    def submit(self, version: int, send, *args) -> None:
        """Starts `send(*args)` (returns the bucket checksums) on the push thread; the previous push
        must have been collected (`collect`)."""
        assert self.inflight is None, "a push is still in flight"
        self.inflight = Push(version, self._pool.submit(self._timed, send, *args))
        self.next_slot ^= 1

    @staticmethod
    def _timed(send, *args):
        return send(*args), time.time()

    def collect(self, block: bool = True) -> PushResult | None:
        """The push in flight once it has finished (waiting for it when `block`), else None."""
        push = self.inflight
        if push is None or (not block and not push.future.done()):
            return None
        t0 = time.perf_counter()
        self.inflight = None
        try:
            sums, done_at = push.future.result()
            error = ""
        except Exception as e:  # noqa: BLE001 - the caller logs it and drops the group
            sums, done_at, error = None, time.time(), f"{type(e).__name__}: {e}"
        return PushResult(push.version, sums, error, push.started_at, done_at, time.perf_counter() - t0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


def decode_stored(frame: bytes, kind, what: str):
    """A frame this run left in Redis before a restart; one of another schema version (the run was
    started by another asyncrl) is a clear error, not a crash in the middle of start-up."""
    try:
        return schema.decode(frame, kind)
    except schema.FrameError as e:
        if e.reason != "schema_version":
            raise
        raise RuntimeError(f"Redis holds {what} of another schema version ({e}): this run was started by "
                           f"another asyncrl; resume it with that one, or start a new run (another run.name)") from e


class Milestones:
    """The start-up milestones (asyncrl/observe/timeline.py), each marked once; after the first push,
    the timeline is printed."""

    def __init__(self, client, keys: Keys):
        self.client, self.keys = client, keys
        self.marked: set[str] = set()  # first batch / step / push

    def mark(self, what: str, t: float | None = None) -> None:
        if what in self.marked:
            return
        self.marked.add(what)
        timeline.mark(self.client, self.keys, what, t)
        if what == "first push":
            marks = timeline.parse(self.client.hgetall(self.keys.timeline))
            print(f"startup: {timeline.describe(marks)}", flush=True)


class Pusher:
    """The learner's weight pushes: every rank takes part in the gathers (`sync_weights`); rank 0,
    which alone is given Redis and the fleet, owns the sender, the push thread and the weight check."""

    def __init__(self, cfg: Config, parts: Parts, version: int, client=None, keys: Keys | None = None,
                 fleet: Fleet | None = None, milestones: Milestones | None = None):
        self.cfg, self.parts = cfg, parts
        self.rank, self.world, self.device, self.cuda = parts.rank, parts.world, parts.device, parts.cuda
        self.client, self.keys, self.fleet, self.milestones = client, keys, fleet, milestones
        self.wire_dtype = to_dtype(cfg.model.dtype)
        self.buckets = plan_buckets([(n, self.wire_dtype, shape) for n, shape in parts.wire_shapes()],
                                    int(cfg.weights.bucket_mb * 2**20))
        # The next step starts while generators load the last push: only where a lag of one version is allowed.
        self.overlap = cfg.weights.overlap and cfg.run.mode == "async" and cfg.algorithm.max_staleness >= 1
        self.push_wait_s = 0.0  # this step's: waiting for the previous push
        self.last_push: PushResult | None = None
        self.last_checksums: list[int] | None = None
        self.sender: WeightSender | None = None
        self.pushes: PushQueue | None = None
        if client is not None:
            self.sender = self._open_sender()
            self.pushes = PushQueue()

    def _open_sender(self) -> WeightSender:
        cfg = self.cfg
        # The version is the checkpoint's (or 0): Redis may hold a later one from before a crash
        # whose update was never persisted.
        epoch0 = 0
        if (frame := self.client.get(self.keys.wgroup)) is not None:
            epoch0 = decode_stored(frame, schema.GroupEpoch, "the last weight-group epoch").epoch
        host = cfg.deploy.bind_host
        if (t := TRANSPORTS.get(cfg.weights.backend)) is not None and t.on_cuda and not self.cuda:
            raise ConfigError(f"weights.backend={cfg.weights.backend} needs the learner on CUDA; this one runs on "
                              "the CPU (weights.backend=auto or gloo)")
        # Each epoch's backend: auto takes ipc when every member shares this node (and CUDA), else NCCL.
        return WeightSender(host, cfg.weights.port, choose_backend(cfg.weights.backend, self.cuda, False),
                            cfg.weights.join_timeout_s, cfg.weights.sync_timeout_s, first_epoch=epoch0,
                            advertise=cfg.deploy.advertise_host, choose=self._epoch_backend)

    def _epoch_backend(self, members: list[str]) -> str:
        return self.fleet.epoch_backend(members, self.cuda)

    def sync_weights(self, version: int) -> float:
        """Pushes the current weights (`version`) to the fleet (every learner rank takes part in the
        gathers) and returns the seconds this held the learner up: gathering and staging the version,
        and waiting for the previous push. The send itself runs on the push thread (PushQueue) and is
        collected at the next push, after a step, or before the fleet changes."""
        t0 = time.perf_counter()
        do_send = torch.tensor([0], dtype=torch.long)
        if self.rank == 0:
            members = self.fleet.live_members()
            if set(members) != set(self.sender.members) or self.sender.pg is None:
                self.finish_push()  # the push in flight belongs to the old group: it ends first
                # `alive` re-reads the fleet while the epoch's members join
                self.sender.open_epoch(members, self._publish_epoch, self._event, alive=self.fleet.live_members,
                                       present=self.fleet.present_members)
            do_send[0] = 1 if self.sender.members else 0
        if self.world > 1:
            dist.broadcast(do_send, src=0)
        if not int(do_send[0]):
            return 0.0
        tensors = self.parts.full_tensors()
        if self.rank != 0:
            for _ in tensors:  # take part in every all-gather, in the same order as rank 0
                pass
            return time.perf_counter() - t0
        checksum = checksum_mode(self.cfg.weights.checksum, self.sender.backend)
        # gloo moves host memory: on CUDA the buckets are packed on the CPU (one copy out of the GPU);
        # NCCL and ipc (transports on CUDA) pack on the GPU.
        send_dev = self.device if self.sender.transport.on_cuda else torch.device("cpu")
        if not self.overlap:
            self._push_now(version, tensors, checksum, send_dev)
        else:
            self._stage_and_submit(version, tensors, checksum, send_dev)
        return time.perf_counter() - t0

    def _stage_and_submit(self, version: int, tensors, checksum: str, send_dev: torch.device) -> None:
        """With the overlap: the version is staged here, into the buffer no send is reading, and its
        send goes to the push thread once the previous one has been collected."""
        try:
            staged = self.sender.stage(self.buckets, pack_buckets(self.buckets, tensors, send_dev), checksum,
                                       slot=self.pushes.next_slot)
        except RuntimeError as e:  # out of memory for the second buffer, say: this version is not pushed
            staged = None
            self.finish_push()
            self._push_failed(version, f"staging: {type(e).__name__}: {e}")
        finally:
            for _ in tensors:  # every all-gather is joined, whatever happened (other ranks are in them)
                pass
        if staged is not None:
            self.finish_push()  # the previous version's send: every member has it before this one is announced
        if staged is None or self.sender.pg is None:  # the group was dropped: the next fleet check re-forms it
            return
        ann = self._announcement(version, checksum)
        self.pushes.submit(version, self._send, ann, staged)

    def _announcement(self, version: int, checksum: str) -> schema.WeightAnnouncement:
        return schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version,
                                         epoch=self.sender.epoch, buckets=self.buckets, announced_at=time.time(),
                                         checksum=checksum)

    def _push_now(self, version: int, tensors, checksum: str, send_dev: torch.device) -> None:
        """Without the overlap (run.mode=sync, staleness 0, weights.overlap=false): the push on this
        thread, waited for (`WeightSender.broadcast`). Over gloo and NCCL the buckets stream (each
        gathered and packed while earlier ones are on the wire, a large tensor sent from its own
        storage); over ipc the version is staged into the one buffer members read from."""
        self.finish_push()
        ann = self._announcement(version, checksum)
        t_start = time.time()
        try:
            set_and_notify(self.client, self.keys, self.keys.wsync, schema.encode(ann), "weights")
            sums = self.sender.broadcast(self.buckets, pack_buckets(self.buckets, tensors, send_dev), checksum,
                                         version=ann.version)
        except RuntimeError as e:  # SyncTimeout too: a member died mid-push, a load failed, out of memory
            self._push_failed(ann.version, f"{type(e).__name__}: {e}")
            return
        finally:
            for _ in tensors:  # every all-gather is joined, whatever happened (other ranks are in them)
                pass
        self._pushed(PushResult(ann.version, sums, "", t_start, time.time(), 0.0))

    def _send(self, ann: schema.WeightAnnouncement, staged) -> list[int]:
        """On the push thread: announce (the wake-up lets generators join at once instead of at their
        next poll), then send."""
        set_and_notify(self.client, self.keys, self.keys.wsync, schema.encode(ann), "weights")
        return self.sender.send(self.buckets, staged, ann.version)

    def finish_push(self, block: bool = True) -> None:
        """Collects the push in flight (waiting for it when `block`): its checksums go to the weight
        check; a failure (a member died mid-push, a timeout) drops the group, which the next fleet
        check re-forms from the live heartbeats."""
        done = self.pushes.collect(block)
        if done is None:
            return
        self.push_wait_s += done.waited_s
        if done.sums is None:
            self._push_failed(done.version, done.error)
        else:
            self._pushed(done)

    def _pushed(self, done: PushResult) -> None:
        self.last_push = done
        self.last_checksums = done.sums
        self.fleet.weight_check.sent(done.version, done.sums)
        self._event("sync", version=done.version, epoch=self.sender.epoch,
                    seconds=f"{done.done_at - done.started_at:.4f}", members=len(self.sender.members))
        if done.version > 0:  # version 0 is the weights the generators started from
            self.milestones.mark("first push", done.done_at)

    def _push_failed(self, version: int, error: str) -> None:
        log.error("weight sync of version %d failed: %s; dropping the group", version, error)
        self._event("sync_failed", version=version, epoch=self.sender.epoch, error=error[:200])
        self.sender.drop_group()

    def _publish_epoch(self, info: schema.GroupEpoch) -> None:
        set_and_notify(self.client, self.keys, self.keys.wgroup, schema.encode(info), "weights")

    def _event(self, kind: str, **fields) -> None:
        log_event(self.client, self.keys, kind, **fields)

    def verify_last_push(self, fleet: dict[str, schema.Heartbeat], version: int,
                         timeout_s: float = 30.0) -> dict[str, schema.Heartbeat]:
        """After the last step's push, wait (bounded) until every live generator reports holding it,
        so that the final version is verified too: `verify_fleet_weights` runs right after the
        broadcast, before a generator has loaded it and said so in its heartbeat (a 2-step CPU run
        of SmolLM2 verified 2 of its 3 pushes). Returns the last fleet snapshot it read."""
        self.finish_push()
        check = self.fleet.weight_check
        if version not in check.synced:
            return fleet  # not pushed (weights.sync_every) or the push failed
        deadline = time.monotonic() + min(timeout_s, self.cfg.weights.sync_timeout_s)
        ids = {member.rsplit(".", 1)[0] for member in self.sender.members}  # who was sent it
        while not all((gid, version) in check.verified for gid in ids):
            if time.monotonic() >= deadline:
                log.warning("not every generator reported version %d within %.0fs of the last push", version,
                            timeout_s)
                break
            time.sleep(0.1)
            fleet = self.fleet.read_fleet()
            self.fleet.verify_fleet_weights(fleet, version)
        return fleet

    def close(self) -> None:
        """Rank 0 at the end: the last push is collected, the push thread ends."""
        self.finish_push()
        self.pushes.close()
