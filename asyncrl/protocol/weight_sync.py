"""The weight-broadcast group protocol, shared by the learner (sender) and the generators (receivers).

Group epochs: learner rank 0 owns a TCPStore. When the set of live generators differs from the
current group's members it opens a new epoch: writes a GroupEpoch to Redis, waits up to
`join_timeout_s` for each member's `ready/{id}` key under `PrefixStore(epoch/{n})`, and either sets
`decision=go` (everyone came; all build a fresh group) or `decision=reform` (the missing ones are
dropped and the next epoch is opened without them). Nobody ever blocks on a dead peer for longer
than a timeout.

Transfer: the model's tensors in flat uint8 buckets (asyncrl/protocol/weight_buckets.py); a
WeightAnnouncement with names/dtypes/shapes/offsets goes to Redis first, then the epoch's transport
moves the buckets (asyncrl/protocol/transports/: gloo on CPU, NCCL on CUDA across nodes, CUDA ipc on
the learner's node), each registered by name in one table that `weights.backend` and its `auto` read.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.protocol import torch_private
from asyncrl.protocol.schema import SCHEMA_VERSION, Bucket, GroupEpoch, WeightAnnouncement
from asyncrl.protocol.tcpstore import master_store
from asyncrl.protocol.transports import TRANSPORTS
from asyncrl.protocol.transports.base import SyncAbandoned, SyncTimeout, Transport
from asyncrl.protocol.transports.ipc import IpcGroup, ipc_export, ipc_open
from asyncrl.protocol.weight_buckets import (
    ALIGN,
    CHECKSUMS,
    DIRECT_BYTES,
    MASK64,
    PIPELINE_DEPTH,
    SAMPLE_STRIDE_WORDS,
    bucket_checksum,
    bucket_mode,
    device_checksums,
    dtype_name,
    flat_offsets,
    pack_buckets,
    plan_buckets,
    to_dtype,
)

# Names of the bucket layer and the transports that callers have always imported from here.
__all__ = ["ALIGN", "BACKENDS", "CHECKSUMS", "DIRECT_BYTES", "MASK64", "PIPELINE_DEPTH", "SAMPLE_STRIDE_WORDS",
           "IpcGroup", "Staged", "SyncAbandoned", "SyncTimeout", "WeightReceiver", "WeightSender", "bucket_checksum", "bucket_mode",
           "checksum_mode", "choose_backend", "device_checksums", "dtype_name", "flat_offsets", "ipc_export",
           "ipc_open", "local_address_towards", "new_group", "pack_buckets", "plan_buckets", "to_dtype"]

log = logging.getLogger(__name__)

DECISION_GRACE_S = 5.0  # a member waits this much longer for the epoch's decision than the learner waits for it
BACKENDS = tuple(TRANSPORTS)


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to `host` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def choose_backend(setting: str, cuda: bool, members_on_this_node: bool) -> str:
    """The backend of one group epoch. weights.backend=auto: the transport whose `auto` takes it
    (gloo without CUDA; on CUDA ipc when every member runs on the learner's node, its GPU memory
    being reachable by handle, also one GPU shared by both, where NCCL cannot put two ranks; NCCL
    otherwise)."""
    if setting != "auto":
        if setting not in TRANSPORTS:
            raise ValueError(f"unknown weights.backend {setting!r} (auto, {', '.join(BACKENDS)})")
        return setting
    (name,) = [name for name, t in TRANSPORTS.items() if t.auto(cuda, members_on_this_node)]
    return name


def checksum_mode(setting: str, backend: str) -> str:
    """weights.checksum: auto is the transport's own choice (full on NCCL and ipc, a GPU reduction,
    nearly free; sampled on gloo, see asyncrl/protocol/transports/gloo.py)."""
    if setting == "auto":
        return TRANSPORTS[backend].checksum
    if setting not in CHECKSUMS:
        raise ValueError(f"unknown weights.checksum {setting!r} (auto, full, sampled)")
    return setting


def new_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float, address: str = ""):
    """A group of `backend`'s transport, outside torch.distributed's global state (so it can coexist
    with torchrun's); `address`: the interface that reaches the learner (gloo binds to it)."""
    if backend not in TRANSPORTS:
        raise ValueError(f"unknown weight-group backend {backend!r}")
    return TRANSPORTS[backend].new_group(store, rank, size, timeout_s, address)


@dataclass
class Staged:
    """A version copied into one of the sender's flat buffers (`WeightSender.stage`)."""

    slot: int
    flat: torch.Tensor | None
    views: list[torch.Tensor]  # one per bucket
    checksum: str  # the announcement's mode
    sums: list[int] | None  # taken at staging (device buffers), else by the send


class WeightSender:
    """Learner rank 0's side: group epochs over a TCPStore, and the epoch's transport."""

    def __init__(self, host: str, port: int, backend: str, join_timeout_s: float, sync_timeout_s: float,
                 first_epoch: int = 0, advertise: str = "", choose: Callable[[list[str]], str] | None = None):
        """`backend` is every epoch's, unless `choose` (members -> backend) picks each epoch's."""
        from asyncrl.protocol.security import advertised_host

        # Listens on `host` (deploy.bind_host) only: torch's own master would bind every interface.
        self.store = master_store(host, port, wait_for_workers=False, timeout=timedelta(seconds=join_timeout_s))
        # Published to the members, and gloo's device address (gloo hands it to its peers too), so it
        # is the address they reach us at, never 0.0.0.0 (which a member would read as itself).
        self.host = advertised_host(host, advertise)
        self.port, self.backend = self.store.port, backend
        self.join_timeout_s, self.sync_timeout_s = join_timeout_s, sync_timeout_s
        self.epoch = first_epoch
        self.members: list[str] = []
        self.pg = None
        self.choose = choose
        # Two flat buffers a version is staged in (`stage`): one being sent while the next is written.
        self._flats: list[torch.Tensor | None] = [None, None]
        self._stream = None  # NCCL sends of staged versions: a CUDA stream of their own
        self.present: Callable[[], list[str]] | None = None  # open_epoch's: members that still have a heartbeat

    @property
    def transport(self) -> Transport:
        return TRANSPORTS[self.backend]

    def open_epoch(self, members: list[str], publish: Callable[[GroupEpoch], None],
                   on_event: Callable[..., None], alive: Callable[[], list[str]] | None = None,
                   present: Callable[[], list[str]] | None = None) -> list[str]:
        """Forms a group with as many of `members` as join in time; returns who is in it. `alive`
        (the members admitted to a new epoch), asked every half second while waiting: a member that
        is no longer alive is dropped at once instead of at the join timeout. `present` (the members
        with a heartbeat at all, draining ones included; `alive` when not given): a push to this
        epoch gives up once a member is no longer present (`member_gone`)."""
        members = sorted(members)
        self.pg = None
        self.present = present or alive
        if self.choose is not None:
            self.backend = self.choose(members)
        while True:
            self.epoch += 1
            info = GroupEpoch(schema_version=SCHEMA_VERSION, epoch=self.epoch, addr=self.host, port=self.port,
                              members=members, backend=self.backend, opened_at=time.time())
            publish(info)
            if not members:
                self.members = []
                return []
            ps = dist.PrefixStore(f"epoch/{self.epoch}", self.store)
            deadline = time.monotonic() + self.join_timeout_s
            missing = list(members)
            gone: list[str] = []
            next_alive = time.monotonic() + 0.5
            while missing and time.monotonic() < deadline:
                missing = [m for m in missing if not ps.check([f"ready/{m}"])]
                if missing and alive is not None and time.monotonic() >= next_alive:
                    next_alive = time.monotonic() + 0.5
                    live = set(alive())
                    if gone := [m for m in missing if m not in live]:
                        missing = gone  # the others may still join the re-formed epoch
                        break
                if missing:
                    time.sleep(0.02)
            if missing:
                # Why re-form rather than wait: a dead generator must never hold the learner.
                ps.set("decision", "reform")
                on_event("epoch_reform", epoch=self.epoch, dropped=",".join(missing))
                if gone:
                    log.warning("weight group epoch=%d: %s left the fleet (heartbeat expired) before joining; "
                                "re-forming without them", self.epoch, missing)
                else:
                    log.warning("weight group epoch=%d: %s did not join in %.0fs; re-forming without them",
                                self.epoch, missing, self.join_timeout_s)
                members = [m for m in members if m not in missing]
                continue
            ps.set("decision", "go")
            self.pg = new_group(dist.PrefixStore("pg", ps), 0, len(members) + 1, self.backend, self.sync_timeout_s,
                                address=self.host)
            self.members = members
            on_event("epoch_open", epoch=self.epoch, members=",".join(members))
            log.info("weight group epoch=%d members=%s backend=%s", self.epoch, members, self.backend)
            return members

    def broadcast(self, buckets: list[Bucket], bucket_tensors: Iterator[torch.Tensor],
                  checksum: str = "full", version: int = -1, sums: list[int] | None = None) -> list[int]:
        """Sends each flat bucket (already packed) in order; returns their checksums (`checksum` is
        the announcement's mode, see `bucket_checksum`; `sums` given: taken already, at staging).
        `version` is the announcement's (ipc names its handles and confirmations by it)."""
        assert self.pg is not None, "broadcast without a group"
        return self.transport.broadcast(self, buckets, bucket_tensors, checksum, version, sums)

    def stage(self, buckets: list[Bucket], bucket_tensors: Iterator[torch.Tensor], checksum: str,
              slot: int = 0) -> Staged:
        """Copies every packed bucket into flat buffer `slot` (0 or 1, kept between versions, on the
        buckets' device), so that the version can be sent later while the model moves on. On a GPU
        the checksums are taken here (a reduction on the device, which also waits for the copies);
        host buffers are summed by `send`, off the caller's thread. The caller writes a slot again
        only once the send that read it has returned."""
        offsets = flat_offsets(buckets)
        views, flat = [], None
        for i, (bucket, buf) in enumerate(zip(buckets, bucket_tensors, strict=True)):
            assert buf.numel() == bucket.nbytes and buf.dtype == torch.uint8
            if flat is None:
                flat = self._flats[slot]
                if flat is None or flat.numel() != offsets[-1] or flat.device != buf.device:
                    self._flats[slot] = None  # the old one is freed first
                    flat = self._flats[slot] = torch.empty(offsets[-1], dtype=torch.uint8, device=buf.device)
            dst = flat[offsets[i]: offsets[i] + bucket.nbytes]
            dst.copy_(buf)  # in stream order: a packing slot is refilled only after this copy
            views.append(dst)
        sums = None
        if flat is not None and flat.device.type == "cuda":
            sums = device_checksums(views, buckets, checksum)  # synchronises: every copy has landed
            torch.cuda.current_stream(flat.device).synchronize()
        return Staged(slot=slot, flat=flat, views=views, checksum=checksum, sums=sums)

    def send(self, buckets: list[Bucket], staged: Staged, version: int) -> list[int]:
        """Sends a staged version to the group's members and returns the bucket checksums: ipc hands
        out handles of the slot and waits until every member confirmed; gloo and NCCL broadcast the
        slot's buckets (the same pipelining and closing all-reduce as `broadcast`)."""
        assert self.pg is not None, "send without a group"
        return self.transport.send(self, buckets, staged, version)

    def member_gone(self) -> str:
        """Why a push to this epoch cannot finish ('' while every member is alive): asked between the
        slices of a wait (asyncrl/protocol/transports/collective.py `wait_work`)."""
        if self.present is None or not self.members:
            return ""
        gone = sorted(set(self.members) - set(self.present()))
        return f"{', '.join(gone)} left the fleet mid-push (heartbeat expired)" if gone else ""

    def drop_group(self) -> None:
        """After a failed push: the epoch is given up in its store, so that members still waiting in
        it for bytes that will not come leave it at once (`WeightReceiver.epoch_given_up`)."""
        if self.pg is not None:
            try:
                dist.PrefixStore(f"epoch/{self.epoch}", self.store).set("abandon", "1")
            except Exception as e:  # noqa: BLE001 - members then wait out their own timeout, as before
                log.warning("weight group epoch=%d: could not mark it given up (%s)", self.epoch, e)
        self.pg = None
        self.members = []

    def close(self) -> None:
        self.pg = None


class WeightReceiver:
    """A generator's side (inside each vLLM worker, or in the HF backend's process)."""

    def __init__(self, member_id: str):
        self.member_id = member_id
        self.backend = "gloo"
        self.epoch = -1
        self.pg = None
        self._store = None
        self._epoch_store = None  # the joined epoch's keys in the learner's store
        # Host receive buffers handed out lately, newest last: `_buffer` takes one back once nothing
        # else refers to its storage. Bounded: between syncs at most this many buffers stay alive.
        self._recent: collections.deque[torch.Tensor] = collections.deque(maxlen=PIPELINE_DEPTH + 2)
        self.opened: dict[tuple, torch.Tensor] = {}  # ipc: the learner's flat buffers, each opened once per handle
        self.shares_device = False  # ipc: the learner's buffer is on this process's current GPU
        self.checksums: list[int] = []
        self.handle_s = self.checksum_s = 0.0  # ipc: waiting for (and opening) the handle; the checksums

    @property
    def transport(self) -> Transport:
        return TRANSPORTS[self.backend]

    def join(self, info: GroupEpoch, timeout_s: float) -> bool:
        """Joins `info`'s epoch; False when the learner re-formed it without us (look again)."""
        if self.member_id not in info.members:
            self.pg, self.epoch = None, info.epoch
            return False
        rank = info.members.index(self.member_id) + 1
        self._store = dist.TCPStore(info.addr, info.port, is_master=False, timeout=timedelta(seconds=timeout_s))
        ps = dist.PrefixStore(f"epoch/{info.epoch}", self._store)
        ps.set(f"ready/{self.member_id}", "1")
        # The learner decides a poll after its own join_timeout_s, counted from once its publish has
        # returned; a member woken by the publish's stream entry starts its clock earlier. Waiting
        # exactly as long, one that had joined at once timed out a few ms before the decision came
        # (seen in the elastic test's re-formed epoch).
        ps.wait(["decision"], timedelta(seconds=timeout_s + DECISION_GRACE_S))
        if ps.get("decision") != b"go":
            self.pg = None
            return False
        if (transport := TRANSPORTS.get(info.backend)) is not None:  # an unknown one: new_group says so
            transport.join()
        self.opened = {}  # a new epoch may come from a restarted learner: its handles are new
        self._epoch_store = ps
        self.pg = new_group(dist.PrefixStore("pg", ps), rank, len(info.members) + 1, info.backend, timeout_s,
                            address=local_address_towards(info.addr, info.port))
        self.epoch = info.epoch
        self.backend = info.backend
        return True

    def epoch_given_up(self) -> str:
        """Why this member's epoch will send nothing more ('' while it may): the learner marked it
        given up after a failed push, or its store is gone with it. Asked between wait slices."""
        if self._epoch_store is None:
            return ""
        try:
            return "the learner gave this epoch up" if self._epoch_store.check(["abandon"]) else ""
        except Exception as e:  # noqa: BLE001 - the learner's store is gone: so is the learner
            return f"the learner's store is unreachable ({type(e).__name__})"

    def receive(self, ann: WeightAnnouncement, device: torch.device, timeout_s: float,
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) views into each received bucket, bucket by bucket. Drain it: asking
        past the last tensor runs the closing all-reduce that tells the learner everything arrived
        (ipc: the views are valid until `finish`; load them before, never keep them after)."""
        assert self.pg is not None and ann.epoch == self.epoch, "receive outside the announced epoch"
        yield from self.transport.receive(self, ann, device, timeout_s)

    def finish(self, ann: WeightAnnouncement, error: str = "") -> None:
        """ipc: tells the learner this member is done with `ann`'s buffer (loaded, or failed with
        `error`), after the device has finished reading it. A no-op on gloo and NCCL, whose closing
        all-reduce already said so."""
        self.transport.finish(self, ann, error)

    def _buffer(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A flat uint8 receive buffer of `nbytes`. On the host: the smallest large-enough recent
        buffer whose storage nothing else refers to (no view the loader kept, no broadcast in flight),
        else a fresh one. Why: a fresh host buffer is page-faulted in as it is received (the kernel
        zeroes every page); that cost more per sync than the checksums (perf: 17k faults per receiver
        for a 400 MB push in 16 MiB buckets, glibc having returned the freed buckets to the OS). CUDA
        buffers come from the caching allocator, which already recycles them."""
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        best = None
        for i, b in enumerate(self._recent):
            if b.numel() >= nbytes and _unshared(b) and (best is None or b.numel() < self._recent[best].numel()):
                best = i
        if best is None:
            base = torch.empty(nbytes, dtype=torch.uint8)
        else:
            base = self._recent[best]
            del self._recent[best]
        self._recent.append(base)
        return base[:nbytes]


def _unshared(base: torch.Tensor) -> bool:
    """True when `base` holds the only reference to its storage (views and in-flight work hold one each).

    Without a use count (asyncrl/protocol/torch_private.py), nothing is ever reused: fresh buffers."""
    return torch_private.storage_use_count(base) == 2  # `base` and the temporary storage object
