"""The interface every weight transport implements (one module each, registered by name in
asyncrl/protocol/transports/__init__.py `TRANSPORTS`).

A transport moves one version's flat buckets (asyncrl/protocol/weight_buckets.py) from learner rank 0
(`WeightSender`) to the members of a group epoch (`WeightReceiver`, asyncrl/protocol/weight_sync.py):
the group epochs, the announcement and the staging are the protocol's and the same for all. A
transport is stateless: what it keeps between calls lives on the sender or receiver it is given
(`sender`: a `WeightSender`, `receiver`: a `WeightReceiver`, `staged`: a `Staged`, all of
asyncrl/protocol/weight_sync.py, which imports this module, so their names are not imported here).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from asyncrl.protocol.schema import Bucket, WeightAnnouncement


class SyncTimeout(RuntimeError):
    """A member did not join or a broadcast did not finish within its timeout."""


class SyncAbandoned(RuntimeError):
    """A broadcast given up before its timeout: a member left the fleet mid-push (the learner's side),
    or the learner gave the epoch up (a member's side), so nobody waits for bytes that cannot come."""


class Transport:
    name = ""
    on_cuda = False  # buckets go from and into GPU memory: the learner and every member need CUDA
    checksum = "full"  # weights.checksum=auto's mode on this transport
    # Whether its waits are taken in slices that look, between them, for a reason to give up
    # (`collective.wait_work`): a member gone from the fleet, an epoch the learner gave up.
    abandons = False

    def auto(self, cuda: bool, members_on_this_node: bool) -> bool:
        """Whether weights.backend=auto takes this transport (the table is asked in its order)."""
        raise NotImplementedError

    def new_group(self, store: dist.Store, rank: int, size: int, timeout_s: float, address: str):
        """The epoch's `pg` (rank 0 is the learner), outside torch.distributed's global state."""
        raise NotImplementedError

    def join(self) -> None:
        """A member's check before its group is built (e.g. that it has what the transport needs)."""

    def broadcast(self, sender, buckets: list[Bucket], bucket_tensors: Iterator[torch.Tensor],
                  checksum: str, version: int, sums: list[int] | None) -> list[int]:
        """Sends packed buckets as they come (`WeightSender.broadcast`); returns their checksums."""
        raise NotImplementedError

    def send(self, sender, buckets: list[Bucket], staged, version: int) -> list[int]:
        """Sends a staged version (`WeightSender.send`); returns the bucket checksums."""
        raise NotImplementedError

    def receive(self, receiver, ann: WeightAnnouncement, device: torch.device,
                timeout_s: float) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every tensor of `ann`, bucket by bucket; the receiver's `checksums` filled."""
        raise NotImplementedError

    def finish(self, receiver, ann: WeightAnnouncement, error: str = "") -> None:
        """Tells the learner this member is done with `ann` (loaded, or failed with `error`), where the
        transport needs that said; a no-op otherwise."""
