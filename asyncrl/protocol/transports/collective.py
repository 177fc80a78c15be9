"""What the collective transports (gloo, NCCL) share: each bucket broadcast from rank 0, pipelined
on both ends, and a closing all-reduce that every member joins after its last bucket, so that the
learner's broadcast returns only once every member has every bucket.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.protocol.schema import Bucket, WeightAnnouncement
from asyncrl.protocol.transports.base import SyncAbandoned, SyncTimeout, Transport
from asyncrl.protocol.weight_buckets import PIPELINE_DEPTH, bucket_checksum, bucket_mode, tensor_views

log = logging.getLogger("asyncrl.protocol.weight_sync")  # the weight protocol's records keep their one name


def start_broadcast(pg, tensor: torch.Tensor, timeout_s: float):
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = timedelta(seconds=timeout_s)
    return pg.broadcast([tensor], opts)


WAIT_SLICE_S = 0.5  # an abandoning wait looks for a reason to give up this often


_GIVEN_UP: list[tuple[list, tuple]] = []  # work of given-up waits, and what it uses, until it ends


def keep_until_done(works, *keep) -> None:
    """Holds still-posted work of a given-up wait, with its group and buffers (`keep`), until the
    work ends at its own timeout: gloo's work, destroyed while posted, blocks the destroying thread
    until then (which held a member out of the next epoch for the whole timeout)."""
    _GIVEN_UP[:] = [(ws, k) for ws, k in _GIVEN_UP if not all(w.is_completed() for w in ws)]
    _GIVEN_UP.append((list(works), keep))


def wait_work(work, timeout_s: float, what: str = "broadcast", abandon: Callable[[], str] | None = None,
              keep: tuple = ()) -> None:
    """Waits for `work` up to `timeout_s`. With `abandon` (a transport whose work can be waited for in
    slices: gloo's leaves a sliced-off wait pending), it is asked between slices and a non-empty answer
    (why) gives the wait up at once: a member killed mid-push otherwise held every other member in
    its receive, and the learner in its send, for the whole timeout (60 s by default). Given up, the
    work is kept (`keep_until_done`) with `keep` (its group, its buffers)."""
    if abandon is None:
        if not work.wait(timedelta(seconds=timeout_s)):
            raise SyncTimeout(f"{what} did not finish in {timeout_s}s")
        return
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            work.wait(timedelta(seconds=max(min(WAIT_SLICE_S, left), 0.001)))
            return
        except RuntimeError:
            if work.is_completed():
                # Done after all (it may finish right after the slice ran out): wait() returns, or
                # raises the work's own failure (a peer's connection closed, say).
                work.wait()
                return
        if why := abandon():
            keep_until_done([work], *keep)
            raise SyncAbandoned(f"{what} given up: {why}")
        if left <= WAIT_SLICE_S:
            raise SyncTimeout(f"{what} did not finish in {timeout_s}s")


def all_received(pg, device: torch.device, timeout_s: float, abandon: Callable[[], str] | None = None) -> None:
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
    wait_work(pg.allreduce([done], opts), timeout_s, "the closing all-reduce (every member has every bucket)", abandon,
              keep=(pg, done))


class Collective(Transport):
    def home_device(self) -> torch.device:
        """The sender's device for the closing all-reduce when there is no bucket to take it from."""
        raise NotImplementedError

    def receive_device(self, device: torch.device) -> torch.device:
        """Where a member receives buckets, given the loader's `device`."""
        return device

    def broadcast(self, sender, buckets: list[Bucket], bucket_tensors: Iterator[torch.Tensor], checksum: str,
                  version: int, sums: list[int] | None) -> list[int]:
        # Pipelined: up to PIPELINE_DEPTH buckets are on the wire while the next one is gathered and
        # packed (the zip pulls it only after the previous broadcast was started). Several in flight,
        # not one: a receiver that is scheduled late (more processes than cores) then does not stall
        # the whole fleet at every bucket boundary.
        known, sums, in_flight = sums, [], collections.deque()  # `sums` given: taken already (at staging)
        device = self.home_device()
        abandon = sender.member_gone if self.abandons else None
        for bucket, buf in zip(buckets, bucket_tensors, strict=True):
            device = buf.device
            assert buf.numel() == bucket.nbytes and buf.dtype == torch.uint8
            work = start_broadcast(sender.pg, buf, sender.sync_timeout_s)
            if known is None:  # read-only while it is being sent
                sums.append(bucket_checksum(buf, bucket_mode(bucket, checksum)))
            in_flight.append((work, buf))  # a direct bucket is a parameter's own storage: keep it alive
            while len(in_flight) >= PIPELINE_DEPTH:  # frees the pool slot pack_buckets fills next
                self._wait_oldest(sender, in_flight, abandon)
        while in_flight:
            self._wait_oldest(sender, in_flight, abandon)
        all_received(sender.pg, device, sender.sync_timeout_s, abandon)
        return sums if known is None else known

    @staticmethod
    def _wait_oldest(sender, in_flight: collections.deque, abandon: Callable[[], str] | None) -> None:
        work, buf = in_flight.popleft()
        try:
            wait_work(work, sender.sync_timeout_s, abandon=abandon, keep=(sender.pg, buf))
        except SyncAbandoned:
            keep_until_done([w for w, _ in in_flight], sender.pg, [b for _, b in in_flight])
            raise

    def send(self, sender, buckets: list[Bucket], staged, version: int) -> list[int]:
        """The staged slot's buckets, broadcast as `broadcast` does."""
        if staged.flat is not None and staged.flat.is_cuda:
            # NCCL: on a stream of its own. On the caller's (the default stream, which the learner's
            # next step fills) each bucket would wait for the step's queued kernels, and the step's
            # later kernels for the broadcast. The staged buffer is complete (`stage` synchronised).
            if sender._stream is None or sender._stream.device != staged.flat.device:
                sender._stream = torch.cuda.Stream(staged.flat.device)
            with torch.cuda.stream(sender._stream):
                return self.broadcast(sender, buckets, iter(staged.views), staged.checksum, version, staged.sums)
        return self.broadcast(sender, buckets, iter(staged.views), staged.checksum, version, staged.sums)

    def receive(self, receiver, ann: WeightAnnouncement, device: torch.device,
                timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        device = self.receive_device(device)
        # This receive's own group and checksum list: a receive that outlives its sync (a staging
        # thread given up on) must not post onto a group joined since, nor add to a later list.
        pg, sums = receiver.pg, []
        receiver.checksums = sums
        abandon = receiver.epoch_given_up if self.abandons else None

        def post(bucket):
            # A buffer per bucket, not one for the whole model: measured faster on CPU (one huge block
            # is faulted in anew at every sync).
            buf = receiver._buffer(bucket.nbytes, device)
            return buf, start_broadcast(pg, buf, timeout_s)

        # Pipelined like the sender: the next PIPELINE_DEPTH - 1 buckets are already being received
        # while the loader copies this one's tensors. A buffer is reused only when the loader kept no
        # view of it (see `WeightReceiver._buffer`).
        posted = collections.deque(post(b) for b in ann.buckets[:PIPELINE_DEPTH])
        for i, bucket in enumerate(ann.buckets):
            buf, work = posted.popleft()
            try:
                wait_work(work, timeout_s, abandon=abandon, keep=(pg, buf))
            except SyncAbandoned:
                keep_until_done([w for _, w in posted], pg, [b for b, _ in posted])
                if receiver.pg is pg:
                    receiver.pg = None
                raise
            if i + PIPELINE_DEPTH < len(ann.buckets):
                posted.append(post(ann.buckets[i + PIPELINE_DEPTH]))
            sums.append(bucket_checksum(buf, bucket_mode(bucket, ann.checksum)))
            yield from tensor_views(buf, bucket)
        # Runs when the consumer asks past the last tensor: every caller drains the iterator.
        try:
            all_received(pg, device, timeout_s, abandon)
        except (SyncTimeout, RuntimeError) as e:
            # Every bucket is here and checksummed: keep the weights (the learner counts this sync
            # as failed and verifies nothing of it). Another member failed the closing all-reduce, so
            # this epoch's group is broken: the learner re-forms it at its next fleet check.
            log.warning("member %s: all %d buckets of version %d received, but the closing all-reduce failed"
                        " (%s); keeping them, leaving the broken group", receiver.member_id, len(sums), ann.version, e)
            if receiver.pg is pg:
                receiver.pg = None
