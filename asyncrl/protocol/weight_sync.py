"""The weight-broadcast group protocol, shared by the learner (sender) and the generators (receivers).

Group epochs: learner rank 0 owns a TCPStore. When the set of live generators differs from the
current group's members it opens a new epoch: writes a GroupEpoch to Redis, waits up to
`join_timeout_s` for each member's `ready/{id}` key under `PrefixStore(epoch/{n})`, and either sets
`decision=go` (everyone came; all build a fresh ProcessGroup) or `decision=reform` (the missing ones
are dropped and the next epoch is opened without them). Nobody ever blocks on a dead peer for longer
than a timeout.

Transfer: small tensors are packed into flat uint8 buckets of at most `bucket_bytes`; a tensor of
DIRECT_BYTES or more gets a bucket of its own and is sent from its own storage when its dtype and
device already match (no copy); a WeightAnnouncement with names/dtypes/shapes/offsets goes to
Redis first, then each bucket is broadcast from rank 0, and the broadcast ends in an all-reduce that
every member joins after its last bucket (`_all_received`): the learner's broadcast returns only once
every member has every bucket. gloo on CPU, NCCL on CUDA, one code path.

CUDA IPC (`ipc`, members on the learner's node): no collective at all. The learner packs every bucket
into one flat buffer in its GPU memory, writes its CUDA IPC handle (an IpcExport) for each member to
the epoch's store, and waits until each has confirmed; a member opens the handle once (cached), reads
the buckets from the learner's memory straight into its model, checksums them on the device and
confirms. The flat buffer is written again only after every member confirmed the version before.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from asyncrl.protocol import torch_private
from asyncrl.protocol.schema import (
    SCHEMA_VERSION,
    Bucket,
    GroupEpoch,
    IpcExport,
    TensorMeta,
    WeightAnnouncement,
    encode,
)
from asyncrl.protocol.tcpstore import master_store

log = logging.getLogger(__name__)

ALIGN = 64  # byte alignment of every tensor inside a bucket, so views of any dtype are legal
# A tensor of at least this many bytes gets a bucket of its own, so that the sender can broadcast its
# storage as it is (no packing copy) when dtype and device already match. Nearly all of an LLM's bytes
# are in such matrices; the small ones (norms, biases) are still packed together.
DIRECT_BYTES = 1 << 20
PIPELINE_DEPTH = 4  # buckets in flight at once, on both ends (the sender's packing pool has as many)
DECISION_GRACE_S = 5.0  # a member waits this much longer for the epoch's decision than the learner waits for it


class SyncTimeout(RuntimeError):
    """A member did not join or a broadcast did not finish within its timeout."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def plan_buckets(metas: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int,
                 direct_bytes: int = DIRECT_BYTES) -> list[Bucket]:
    """Groups (name, dtype, shape) into buckets of at most `bucket_bytes`; offsets are ALIGN-aligned.

    A tensor of `direct_bytes` or more gets a bucket of its own (sent without a copy when it can be)."""
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    used = 0
    for name, dtype, shape in metas:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes >= direct_bytes:  # closes the open bucket first: buckets follow the tensors' order
            if current:
                buckets.append(Bucket(nbytes=_pad(used), tensors=current))
                current, used = [], 0
            buckets.append(Bucket(nbytes=_pad(nbytes), tensors=[TensorMeta(
                name=name, dtype=dtype_name(dtype), shape=list(shape), offset=0, nbytes=nbytes)]))
            continue
        offset = -(-used // ALIGN) * ALIGN
        if current and offset + nbytes > bucket_bytes:
            buckets.append(Bucket(nbytes=_pad(used), tensors=current))
            current, used, offset = [], 0, 0
        current.append(TensorMeta(name=name, dtype=dtype_name(dtype), shape=list(shape), offset=offset, nbytes=nbytes))
        used = offset + nbytes
    if current:
        buckets.append(Bucket(nbytes=_pad(used), tensors=current))
    return buckets


def _pad(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that routes to `host` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


BACKENDS = ("gloo", "nccl", "ipc")


def choose_backend(setting: str, cuda: bool, members_on_this_node: bool) -> str:
    """The backend of one group epoch. weights.backend=auto: gloo without CUDA; on CUDA ipc when every
    member runs on the learner's node (its GPU memory is reachable by handle, also one GPU shared by
    both, where NCCL cannot put two ranks), NCCL otherwise."""
    if setting != "auto":
        if setting not in BACKENDS:
            raise ValueError(f"unknown weights.backend {setting!r} (auto, {', '.join(BACKENDS)})")
        return setting
    if not cuda:
        return "gloo"
    return "ipc" if members_on_this_node else "nccl"


def flat_offsets(buckets: list[Bucket]) -> list[int]:
    """Each bucket's byte offset in the ipc flat buffer (ALIGN-aligned, in order); the last entry is
    the buffer's size."""
    offsets, end = [], 0
    for b in buckets:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + b.nbytes
    offsets.append(-(-end // ALIGN) * ALIGN)
    return offsets


class IpcGroup:
    """The `pg` of an ipc epoch: no collective, only the epoch's store (handles and confirmations)."""

    def __init__(self, store: dist.Store, rank: int, size: int):
        self.store, self.rank, self.size = store, rank, size


def ipc_export(buf: torch.Tensor, version: int) -> IpcExport:
    """A CUDA IPC handle of `buf` (a flat uint8 CUDA tensor) through torch's tensor reduction, the
    fields written out so that they travel as msgpack, not as a pickle."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    device, handle, size, offset = args[6], args[7], args[8], args[9]
    return IpcExport(schema_version=SCHEMA_VERSION, version=version,
                     device_uuid=str(torch.cuda.get_device_properties(device).uuid), handle=bytes(handle),
                     storage_size=int(size), storage_offset=int(offset), ref_counter_handle=bytes(args[11]),
                     ref_counter_offset=int(args[12]), event_handle=bytes(args[13] or b""),
                     event_sync_required=bool(args[14]), nbytes=buf.numel())


def ipc_open(export: IpcExport) -> torch.Tensor:
    """The learner's flat buffer, opened in this process's address space (torch caches the mapping per
    handle: a handle opened before is not mapped again)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if export.device_uuid not in uuids:
        raise RuntimeError(f"weights.backend=ipc: the learner's GPU {export.device_uuid} is not visible here "
                           f"(this process sees {len(uuids)} GPUs); use nccl across nodes or containers")
    device = uuids.index(export.device_uuid)
    return rebuild_cuda_tensor(torch.Tensor, torch.Size([export.nbytes]), (1,), 0, torch.TypedStorage, torch.uint8,
                               device, export.handle, export.storage_size, export.storage_offset, False,
                               export.ref_counter_handle, export.ref_counter_offset, export.event_handle or None,
                               export.event_sync_required)


def new_group(store: dist.Store, rank: int, size: int, backend: str, timeout_s: float, address: str = ""):
    """A process group outside torch.distributed's global state (so it can coexist with torchrun's).

    gloo binds to `address` (the interface that reaches the learner) unless GLOO_SOCKET_IFNAME is
    set: by default gloo resolves the hostname, which on some machines names an unreachable address.
    """
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        # gloo runs each collective on one of its worker threads (2 by default) and a receive is
        # posted only once a thread has picked its broadcast up: as many threads as buckets in
        # flight. Measured, 100M params to 1 receiver on 2 cores: 0.15-0.17 s vs 0.18-0.20 s a push.
        return torch_private.gloo_group(store, rank, size, timeout, threads=PIPELINE_DEPTH,
                                        interface=os.environ.get("GLOO_SOCKET_IFNAME", ""),
                                        hostname=address or "127.0.0.1")
    if backend == "nccl":
        return torch_private.nccl_group(store, rank, size, timeout)
    if backend == "ipc":
        return IpcGroup(store, rank, size)
    raise ValueError(f"unknown weight-group backend {backend!r}")


def _start_broadcast(pg, tensor: torch.Tensor, timeout_s: float):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timedelta(seconds=timeout_s)
    return pg.broadcast([tensor], opts)


def _wait(work, timeout_s: float, what: str = "broadcast") -> None:
    if not work.wait(timedelta(seconds=timeout_s)):
        raise SyncTimeout(f"{what} did not finish in {timeout_s}s")


def _all_received(pg, device: torch.device, timeout_s: float) -> None:
    """The last step of a broadcast on every end: an all-reduce of one element, so that the
    learner's broadcast returns only once every member has every bucket.

    Why: a gloo send completes once its bytes are in the socket buffer. A model that fits there (the
    tiny one) had been "broadcast" before a slow member even read the announcement; the learner then
    announced the next version over it, and that member received the skipped version's bytes under
    the later version's name, one behind from then on (the elastic test on CI: g2 reported version
    53 with the checksums of 52). With this, the next announcement can only come after every member
    has finished the one before."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    opts.timeout = timedelta(seconds=timeout_s)
    done = torch.ones(1, dtype=torch.int64, device=device)  # the buckets' device: NCCL's communicator
    _wait(pg.allreduce([done], opts), timeout_s, "the closing all-reduce (every member has every bucket)")


# A sampled checksum reads one 8-byte word per this many: one per 4 KiB page, 1/64 of the cache lines.
SAMPLE_STRIDE_WORDS = 512
CHECKSUMS = ("full", "sampled")


def checksum_mode(setting: str, backend: str) -> str:
    """weights.checksum: auto is full on NCCL and ipc (a GPU reduction, nearly free) and sampled on gloo,
    where a full read of every bucket on both ends costs host CPU that the transfer itself needs
    (measured on 2 cores: sampled pushes took 5-38% less time than full ones,
    benchmarks/results/weight_sync_cpu_sampled_2026-12-01.json)."""
    if setting == "auto":
        return "full" if backend in ("nccl", "ipc") else "sampled"
    if setting not in CHECKSUMS:
        raise ValueError(f"unknown weights.checksum {setting!r} (auto, full, sampled)")
    return setting


def bucket_mode(bucket: Bucket, mode: str) -> str:
    """The checksum one bucket gets: `sampled` applies to a bucket of one tensor (the large matrices,
    nearly all of a model's bytes); a packed bucket of small tensors (norms, biases, some under one
    4 KiB stride) is summed in full, so that every tensor in it is read."""
    return mode if len(bucket.tensors) == 1 else "full"


def bucket_checksum(buf: torch.Tensor, mode: str = "full") -> int:
    """A cheap checksum of a flat uint8 bucket, identical on CPU and CUDA: the wrapping sum (mod
    2**64) of its 8-byte words (buckets are padded to whole words by `plan_buckets`).

    full: every word, one pass of memory bandwidth; it catches lost, truncated, stale or corrupted
    buckets, not reorderings. sampled: a bucket under DIRECT_BYTES in full; a larger one by one word
    per 4 KiB plus its last word (`bucket_mode` keeps packed buckets on full). It catches a lost,
    stale (still holding another version's or bucket's bytes), shifted or truncated bucket, which
    are the failures of the protocol; not a byte corrupted inside a page, which the transport's own
    integrity checks are for (TCP's for gloo)."""
    if mode not in CHECKSUMS:
        raise ValueError(f"unknown checksum mode {mode!r} (full, sampled)")
    sampled = mode == "sampled" and buf.numel() >= DIRECT_BYTES
    if buf.device.type == "cpu":
        # numpy, single-threaded: torch's sum wakes its OpenMP pool, whose threads then spin-wait
        # after every bucket; with more processes than cores that spinning took ~19% of all CPU
        # time from gloo's I/O threads (perf, 2 receivers on 2 cores). Same result: addition mod
        # 2**64 does not depend on the order.
        words = buf.detach().numpy().view(np.uint64)
        if not sampled:
            return int(words.sum(dtype=np.uint64))
        return (int(words[::SAMPLE_STRIDE_WORDS].sum(dtype=np.uint64)) + int(words[-1])) & MASK64
    return int(_device_checksum(buf, sampled)) & MASK64


MASK64 = 0xFFFFFFFFFFFFFFFF


def _device_checksum(buf: torch.Tensor, sampled: bool) -> torch.Tensor:
    words = buf.view(torch.int64)
    return words[::SAMPLE_STRIDE_WORDS].sum() + words[-1] if sampled else words.sum()


def device_checksums(bufs: list[torch.Tensor], buckets: list[Bucket], mode: str) -> list[int]:
    """`bucket_checksum` of many CUDA buckets with one synchronisation instead of one per bucket."""
    if not bufs:
        return []
    sums = [_device_checksum(b, bucket_mode(bk, mode) == "sampled" and b.numel() >= DIRECT_BYTES)
            for b, bk in zip(bufs, buckets, strict=True)]
    return [int(x) & MASK64 for x in torch.stack(sums).tolist()]


@dataclass
class Staged:
    """A version copied into one of the sender's flat buffers (`WeightSender.stage`)."""

    slot: int
    flat: torch.Tensor | None
    views: list[torch.Tensor]  # one per bucket
    checksum: str  # the announcement's mode
    sums: list[int] | None  # taken at staging (device buffers), else by the send


class WeightSender:
    """Learner rank 0's side: group epochs over a TCPStore and bucketed broadcasts."""

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

    def open_epoch(self, members: list[str], publish: Callable[[GroupEpoch], None],
                   on_event: Callable[..., None], alive: Callable[[], list[str]] | None = None) -> list[str]:
        """Forms a group with as many of `members` as join in time; returns who is in it. `alive`
        (the members whose heartbeat is current), asked every half second while waiting: a member
        that is no longer alive is dropped at once instead of at the join timeout."""
        members = sorted(members)
        self.pg = None
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
        """Broadcasts each flat bucket (already packed) in order; returns their checksums (`checksum`
        is the announcement's mode, see `bucket_checksum`). `version` is the announcement's (ipc
        names its handles and confirmations by it)."""
        assert self.pg is not None, "broadcast without a group"
        if self.backend == "ipc":
            return self._share(buckets, bucket_tensors, checksum, version)
        # Pipelined: up to PIPELINE_DEPTH buckets are on the wire while the next one is gathered and
        # packed (the zip pulls it only after the previous broadcast was started). Several in flight,
        # not one: a receiver that is scheduled late (more processes than cores) then does not stall
        # the whole fleet at every bucket boundary.
        known, sums, in_flight = sums, [], collections.deque()  # `sums` given: taken already (at staging)
        device = torch.device("cpu") if self.backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
        for bucket, buf in zip(buckets, bucket_tensors, strict=True):
            device = buf.device
            assert buf.numel() == bucket.nbytes and buf.dtype == torch.uint8
            work = _start_broadcast(self.pg, buf, self.sync_timeout_s)
            if known is None:  # read-only while it is being sent
                sums.append(bucket_checksum(buf, bucket_mode(bucket, checksum)))
            in_flight.append((work, buf))  # a direct bucket is a parameter's own storage: keep it alive
            while len(in_flight) >= PIPELINE_DEPTH:  # frees the pool slot pack_buckets fills next
                _wait(in_flight.popleft()[0], self.sync_timeout_s)
        while in_flight:
            _wait(in_flight.popleft()[0], self.sync_timeout_s)
        _all_received(self.pg, device, self.sync_timeout_s)
        return sums if known is None else known

    def _share(self, buckets: list[Bucket], bucket_tensors: Iterator[torch.Tensor], checksum: str,
               version: int) -> list[int]:
        """ipc: copies every bucket into the flat buffer (device to device), hands each member its
        handle and waits until all have confirmed (loaded, or failed)."""
        staged = self.stage(buckets, bucket_tensors, checksum)
        return self.send(buckets, staged, version)

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
        if self.backend != "ipc":
            if staged.flat is not None and staged.flat.is_cuda:
                # NCCL: on a stream of its own. On the caller's (the default stream, which the learner's
                # next step fills) each bucket would wait for the step's queued kernels, and the step's
                # later kernels for the broadcast. The staged buffer is complete (`stage` synchronised).
                if self._stream is None or self._stream.device != staged.flat.device:
                    self._stream = torch.cuda.Stream(staged.flat.device)
                with torch.cuda.stream(self._stream):
                    return self.broadcast(buckets, iter(staged.views), staged.checksum, version, sums=staged.sums)
            return self.broadcast(buckets, iter(staged.views), staged.checksum, version, sums=staged.sums)
        pg, members = self.pg, list(self.members)
        for m in members:  # one export each: every member's open releases its own reference count
            pg.store.set(f"ipc/{version}/{m}", encode(ipc_export(staged.flat, version)))
        done = [f"done/{version}/{m}" for m in members]
        try:
            pg.store.wait(done, timedelta(seconds=self.sync_timeout_s))
        except RuntimeError as e:  # the store's timeout (DistStoreError)
            late = [m for m, k in zip(members, done, strict=True) if not pg.store.check([k])]
            raise SyncTimeout(f"ipc: {late} did not confirm version {version} in {self.sync_timeout_s}s") from e
        for m, k in zip(members, done, strict=True):
            if (answer := pg.store.get(k)) != b"ok":
                raise RuntimeError(f"ipc: member {m} failed to load version {version}: {answer.decode()[:200]}")
        return staged.sums

    def drop_group(self) -> None:
        self.pg = None
        self.members = []

    def close(self) -> None:
        self.pg = None


def pack_buckets(buckets: list[Bucket], tensors: Iterator[tuple[str, torch.Tensor]],
                 device: torch.device) -> Iterator[torch.Tensor]:
    """Consumes (name, full tensor) in plan order and yields one filled flat uint8 buffer per bucket.

    A bucket holding one tensor that already has the bucket's dtype and device, is contiguous and
    fills the bucket exactly is yielded as that tensor's own bytes: no copy. Every other bucket is
    packed (cast and copied in one pass) into one of PIPELINE_DEPTH buffers, each grown to the largest
    bucket it has held (none is allocated unless a bucket needs packing), reused in turn: the sender
    keeps fewer than PIPELINE_DEPTH buckets in flight while it asks for the next one, so a slot is
    free again by then.
    """
    it = iter(tensors)
    pool = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(PIPELINE_DEPTH)]  # grown on need
    packed = 0
    for bucket in buckets:
        if len(bucket.tensors) == 1:
            name, t = next(it)
            meta = bucket.tensors[0]
            assert name == meta.name, f"tensor order changed: {name} != {meta.name}"
            t = t.detach()
            if (t.dtype == to_dtype(meta.dtype) and t.device == device and t.is_contiguous()
                    and meta.nbytes == bucket.nbytes):
                yield t.view(-1).view(torch.uint8)
                continue
            parts = [(meta, t)]
        else:
            parts = _named(it, bucket)
        slot = packed % PIPELINE_DEPTH
        if pool[slot].numel() < bucket.nbytes:
            pool[slot] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        buf = pool[slot][: bucket.nbytes]
        packed += 1
        end = 0
        for meta, t in parts:
            assert list(t.shape) == meta.shape, f"{meta.name}: shape {list(t.shape)} != planned {meta.shape}"
            # The alignment gaps and the padding are zeroed: they go on the wire and into the checksum,
            # and a pool buffer holds whatever was there before. Left as they were, two broadcasts of the
            # same version had different checksums, and a generator still holding the first one was
            # reported as a mismatch against the second (CI, the elastic test's re-formed epoch).
            if meta.offset > end:
                buf[end: meta.offset].zero_()
            # One pass: copy_ casts and moves while it writes into the bucket.
            buf[meta.offset: meta.offset + meta.nbytes].view(to_dtype(meta.dtype)).view(meta.shape).copy_(t)
            end = meta.offset + meta.nbytes
        if end < bucket.nbytes:
            buf[end:].zero_()
        yield buf


def _named(it: Iterator[tuple[str, torch.Tensor]], bucket: Bucket) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
    for meta in bucket.tensors:
        name, t = next(it)
        assert name == meta.name, f"tensor order changed: {name} != {meta.name}"
        yield meta, t.detach()


class WeightReceiver:
    """A generator's side (inside each vLLM worker, or in the HF backend's process)."""

    def __init__(self, member_id: str):
        self.member_id = member_id
        self.backend = "gloo"
        self.epoch = -1
        self.pg = None
        self._store = None
        # Host receive buffers handed out lately, newest last: `_buffer` takes one back once nothing
        # else refers to its storage. Bounded: between syncs at most this many buffers stay alive.
        self._recent: collections.deque[torch.Tensor] = collections.deque(maxlen=PIPELINE_DEPTH + 2)
        self._ipc: dict[tuple, torch.Tensor] = {}  # the learner's flat buffers, each opened once per handle
        self.shares_device = False  # ipc: the learner's buffer is on this process's current GPU
        self.checksums: list[int] = []
        self.handle_s = self.checksum_s = 0.0  # ipc: waiting for (and opening) the handle; the checksums

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
        if info.backend == "nccl":
            torch.cuda.set_device(torch.cuda.current_device())
        if info.backend == "ipc" and not torch.cuda.is_available():
            raise RuntimeError("weights.backend=ipc needs CUDA in every generator")
        self._ipc = {}  # a new epoch may come from a restarted learner: its handles are new
        self.pg = new_group(dist.PrefixStore("pg", ps), rank, len(info.members) + 1, info.backend, timeout_s,
                            address=local_address_towards(info.addr, info.port))
        self.epoch = info.epoch
        self.backend = info.backend
        return True

    def receive(self, ann: WeightAnnouncement, device: torch.device, timeout_s: float,
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (name, tensor) views into each received bucket, bucket by bucket. Drain it: asking
        past the last tensor runs the closing all-reduce that tells the learner everything arrived."""
        assert self.pg is not None and ann.epoch == self.epoch, "receive outside the announced epoch"
        if self.backend == "ipc":
            yield from self._receive_ipc(ann, timeout_s)
            return
        if self.backend == "gloo":
            device = torch.device("cpu")  # gloo moves host memory; the loader copies to the GPU
        # This receive's own group and checksum list: a receive that outlives its sync (a staging
        # thread given up on) must not post onto a group joined since, nor add to a later list.
        pg, sums = self.pg, []
        self.checksums = sums

        def post(bucket):
            # A buffer per bucket, not one for the whole model: measured faster on CPU (one huge block
            # is faulted in anew at every sync).
            buf = self._buffer(bucket.nbytes, device)
            return buf, _start_broadcast(pg, buf, timeout_s)

        # Pipelined like the sender: the next PIPELINE_DEPTH - 1 buckets are already being received
        # while the loader copies this one's tensors. A buffer is reused only when the loader kept no
        # view of it (see `_buffer`).
        posted = collections.deque(post(b) for b in ann.buckets[:PIPELINE_DEPTH])
        for i, bucket in enumerate(ann.buckets):
            buf, work = posted.popleft()
            _wait(work, timeout_s)
            if i + PIPELINE_DEPTH < len(ann.buckets):
                posted.append(post(ann.buckets[i + PIPELINE_DEPTH]))
            sums.append(bucket_checksum(buf, bucket_mode(bucket, ann.checksum)))
            for meta in bucket.tensors:
                view = buf[meta.offset: meta.offset + meta.nbytes].view(to_dtype(meta.dtype)).view(meta.shape)
                yield meta.name, view
        # Runs when the consumer asks past the last tensor: every caller drains the iterator.
        try:
            _all_received(pg, device, timeout_s)
        except (SyncTimeout, RuntimeError) as e:
            # Every bucket is here and checksummed: keep the weights (the learner counts this sync
            # as failed and verifies nothing of it). Another member failed the closing all-reduce, so
            # this epoch's group is broken: the learner re-forms it at its next fleet check.
            log.warning("member %s: all %d buckets of version %d received, but the closing all-reduce failed"
                        " (%s); keeping them, leaving the broken group", self.member_id, len(sums), ann.version, e)
            if self.pg is pg:
                self.pg = None

    def _receive_ipc(self, ann: WeightAnnouncement, timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """Views into the learner's flat buffer. They are valid until `finish`: load them into the
        model before, never keep them after (the learner writes the next version there)."""
        from asyncrl.protocol import schema

        store, key = self.pg.store, f"ipc/{ann.version}/{self.member_id}"
        t0 = time.perf_counter()
        try:
            store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise SyncTimeout(f"ipc: no handle for version {ann.version} in {timeout_s}s") from e
        export = schema.decode(store.get(key), schema.IpcExport)
        offsets = flat_offsets(ann.buckets)
        if export.version != ann.version or export.nbytes < offsets[-1]:
            raise RuntimeError(f"ipc: the handle is for version {export.version} ({export.nbytes} bytes), the "
                               f"announcement for {ann.version} ({offsets[-1]} bytes)")
        ident = (export.device_uuid, export.handle, export.storage_offset, export.nbytes)
        if ident not in self._ipc:  # the learner alternates between two buffers: both stay open
            while len(self._ipc) >= 2:
                del self._ipc[next(iter(self._ipc))]
            self._ipc[ident] = ipc_open(export)
        flat = self._ipc[ident]
        self.shares_device = flat.device.index == torch.cuda.current_device()
        bufs = [flat[offsets[i]: offsets[i] + b.nbytes] for i, b in enumerate(ann.buckets)]
        self.handle_s = time.perf_counter() - t0
        self.checksums = device_checksums(bufs, ann.buckets, ann.checksum)
        self.checksum_s = time.perf_counter() - t0 - self.handle_s
        for buf, bucket in zip(bufs, ann.buckets, strict=True):
            for meta in bucket.tensors:
                yield meta.name, buf[meta.offset: meta.offset + meta.nbytes].view(to_dtype(meta.dtype)).view(meta.shape)

    def finish(self, ann: WeightAnnouncement, error: str = "") -> None:
        """ipc: tells the learner this member is done with `ann`'s buffer (loaded, or failed with
        `error`), after the device has finished reading it. A no-op on gloo and NCCL, whose closing
        all-reduce already said so."""
        if self.backend != "ipc" or self.pg is None or ann.epoch != self.epoch:
            return
        if not error:
            torch.cuda.synchronize()  # the loader's copies out of the learner's buffer have finished
        self.pg.store.set(f"done/{ann.version}/{self.member_id}", "ok" if not error else f"error: {error}"[:500])

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
