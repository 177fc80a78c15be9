"""gloo: the weights over TCP from host memory; the transport of a learner without CUDA."""

from __future__ import annotations

import os
from datetime import timedelta

import torch

from asyncrl.protocol import torch_private
from asyncrl.protocol.transports.collective import Collective
from asyncrl.protocol.weight_buckets import PIPELINE_DEPTH


class Gloo(Collective):
    name = "gloo"
    # A full read of every bucket on both ends costs host CPU that the transfer itself needs
    # (measured on 2 cores: sampled pushes took 5-38% less time than full ones,
    # benchmarks/results/weight_sync_cpu_sampled_2026-12-01.json).
    checksum = "sampled"
    abandons = True  # a sliced-off wait stays pending (NCCL's wait only orders streams: not sliced)

    def auto(self, cuda: bool, members_on_this_node: bool) -> bool:
        return not cuda

    def new_group(self, store, rank: int, size: int, timeout_s: float, address: str):
        """gloo binds to `address` (the interface that reaches the learner) unless GLOO_SOCKET_IFNAME
        is set: by default gloo resolves the hostname, which on some machines names an unreachable address."""
        # gloo runs each collective on one of its worker threads (2 by default) and a receive is
        # posted only once a thread has picked its broadcast up: as many threads as buckets in
        # flight. Measured, 100M params to 1 receiver on 2 cores: 0.15-0.17 s vs 0.18-0.20 s a push.
        return torch_private.gloo_group(store, rank, size, timedelta(seconds=timeout_s), threads=PIPELINE_DEPTH,
                                        interface=os.environ.get("GLOO_SOCKET_IFNAME", ""),
                                        hostname=address or "127.0.0.1")

    def home_device(self) -> torch.device:
        return torch.device("cpu")

    def receive_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")  # gloo moves host memory; the loader copies to the GPU


TRANSPORT = Gloo()
