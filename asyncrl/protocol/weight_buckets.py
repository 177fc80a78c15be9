"""The bytes of a weight push, shared by both ends and every transport (asyncrl/protocol/transports/):
tensors planned into flat uint8 buckets, packed, laid out in one flat buffer, and checksummed.

Small tensors are packed into buckets of at most `bucket_bytes`; a tensor of DIRECT_BYTES or more
gets a bucket of its own and is sent from its own storage when its dtype and device already match
(no copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np
import torch

from asyncrl.protocol.schema import Bucket, TensorMeta

ALIGN = 64  # byte alignment of every tensor inside a bucket, so views of any dtype are legal
# A tensor of at least this many bytes gets a bucket of its own, so that the sender can broadcast its
# storage as it is (no packing copy) when dtype and device already match. Nearly all of an LLM's bytes
# are in such matrices; the small ones (norms, biases) are still packed together.
DIRECT_BYTES = 1 << 20
PIPELINE_DEPTH = 4  # buckets in flight at once, on both ends (the sender's packing pool has as many)


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


def flat_offsets(buckets: list[Bucket]) -> list[int]:
    """Each bucket's byte offset in a flat buffer of every bucket (the sender's staging slots, the
    ipc buffer; ALIGN-aligned, in order); the last entry is the buffer's size."""
    offsets, end = [], 0
    for b in buckets:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + b.nbytes
    offsets.append(-(-end // ALIGN) * ALIGN)
    return offsets


def tensor_views(buf: torch.Tensor, bucket: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view) of each tensor in a received flat bucket `buf`."""
    for meta in bucket.tensors:
        yield meta.name, buf[meta.offset: meta.offset + meta.nbytes].view(to_dtype(meta.dtype)).view(meta.shape)


# ---- packing ------------------------------------------------------------------------------------


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
        _fill(buf, parts, bucket.nbytes)
        yield buf


def _fill(buf: torch.Tensor, parts, nbytes: int) -> None:
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
    if end < nbytes:
        buf[end:].zero_()


def _named(it: Iterator[tuple[str, torch.Tensor]], bucket: Bucket) -> Iterator[tuple[TensorMeta, torch.Tensor]]:
    for meta in bucket.tensors:
        name, t = next(it)
        assert name == meta.name, f"tensor order changed: {name} != {meta.name}"
        yield meta, t.detach()


# ---- checksums ----------------------------------------------------------------------------------

# A sampled checksum reads one 8-byte word per this many: one per 4 KiB page, 1/64 of the cache lines.
SAMPLE_STRIDE_WORDS = 512
CHECKSUMS = ("full", "sampled")
MASK64 = 0xFFFFFFFFFFFFFFFF


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
