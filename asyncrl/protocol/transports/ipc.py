"""CUDA IPC (members on the learner's node): no collective at all.

The learner packs every bucket into one flat buffer in its GPU memory, writes its CUDA IPC handle (an
IpcExport) for each member to the epoch's store, and waits until each has confirmed; a member opens
the handle once (cached), reads the buckets from the learner's memory straight into its model,
checksums them on the device and confirms. The flat buffer is written again only after every member
confirmed the version before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.protocol import schema
from asyncrl.protocol.schema import SCHEMA_VERSION, IpcExport, WeightAnnouncement, encode
from asyncrl.protocol.transports.base import SyncTimeout, Transport
from asyncrl.protocol.weight_buckets import device_checksums, flat_offsets, tensor_views


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


class Ipc(Transport):
    name = "ipc"
    on_cuda = True
    checksum = "full"  # a GPU reduction, nearly free

    def auto(self, cuda: bool, members_on_this_node: bool) -> bool:
        # Its GPU memory is reachable by handle, also on one GPU shared by both, where NCCL cannot put two ranks.
        return cuda and members_on_this_node

    def new_group(self, store, rank: int, size: int, timeout_s: float, address: str):
        return IpcGroup(store, rank, size)

    def join(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("weights.backend=ipc needs CUDA in every generator")

    def broadcast(self, sender, buckets, bucket_tensors, checksum: str, version: int, sums) -> list[int]:
        """Copies every bucket into the flat buffer (device to device), hands each member its handle
        and waits until all have confirmed (loaded, or failed)."""
        return self.send(sender, buckets, sender.stage(buckets, bucket_tensors, checksum), version)

    def send(self, sender, buckets, staged, version: int) -> list[int]:
        pg, members = sender.pg, list(sender.members)
        for m in members:  # one export each: every member's open releases its own reference count
            pg.store.set(f"ipc/{version}/{m}", encode(ipc_export(staged.flat, version)))
        done = [f"done/{version}/{m}" for m in members]
        try:
            pg.store.wait(done, timedelta(seconds=sender.sync_timeout_s))
        except RuntimeError as e:  # the store's timeout (DistStoreError)
            late = [m for m, k in zip(members, done, strict=True) if not pg.store.check([k])]
            raise SyncTimeout(f"ipc: {late} did not confirm version {version} in {sender.sync_timeout_s}s") from e
        for m, k in zip(members, done, strict=True):
            if (answer := pg.store.get(k)) != b"ok":
                raise RuntimeError(f"ipc: member {m} failed to load version {version}: {answer.decode()[:200]}")
        return staged.sums

    def receive(self, receiver, ann: WeightAnnouncement, device: torch.device,
                timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """Views into the learner's flat buffer. They are valid until `finish`: load them into the
        model before, never keep them after (the learner writes the next version there)."""
        store, key = receiver.pg.store, f"ipc/{ann.version}/{receiver.member_id}"
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
        flat = self._open(receiver.opened, export)
        receiver.shares_device = flat.device.index == torch.cuda.current_device()
        bufs = [flat[offsets[i]: offsets[i] + b.nbytes] for i, b in enumerate(ann.buckets)]
        receiver.handle_s = time.perf_counter() - t0
        receiver.checksums = device_checksums(bufs, ann.buckets, ann.checksum)
        receiver.checksum_s = time.perf_counter() - t0 - receiver.handle_s
        for buf, bucket in zip(bufs, ann.buckets, strict=True):
            yield from tensor_views(buf, bucket)

    @staticmethod
    def _open(opened: dict, export: IpcExport) -> torch.Tensor:
        """The learner's buffer named by `export`, from `opened` (this epoch's, by handle) or opened now."""
        ident = (export.device_uuid, export.handle, export.storage_offset, export.nbytes)
        if ident not in opened:  # the learner alternates between two buffers: both stay open
            while len(opened) >= 2:
                del opened[next(iter(opened))]
            opened[ident] = ipc_open(export)
        return opened[ident]

    def finish(self, receiver, ann: WeightAnnouncement, error: str = "") -> None:
        if receiver.pg is None or ann.epoch != receiver.epoch:
            return
        if not error:
            torch.cuda.synchronize()  # the loader's copies out of the learner's buffer have finished
        receiver.pg.store.set(f"done/{ann.version}/{receiver.member_id}", "ok" if not error else f"error: {error}"[:500])


TRANSPORT = Ipc()
