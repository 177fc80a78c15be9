"""NCCL: the weights from the learner's GPU memory to the members' GPUs, across nodes."""

from __future__ import annotations

from datetime import timedelta

import torch

from asyncrl.protocol import torch_private
from asyncrl.protocol.transports.collective import Collective


class Nccl(Collective):
    name = "nccl"
    on_cuda = True
    checksum = "full"  # a GPU reduction, nearly free

    def auto(self, cuda: bool, members_on_this_node: bool) -> bool:
        return cuda and not members_on_this_node

    def new_group(self, store, rank: int, size: int, timeout_s: float, address: str):
        return torch_private.nccl_group(store, rank, size, timedelta(seconds=timeout_s))

    def join(self) -> None:
        torch.cuda.set_device(torch.cuda.current_device())

    def home_device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())


TRANSPORT = Nccl()
