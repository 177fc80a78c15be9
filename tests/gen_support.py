"""Driving an in-process engine (vLLM or HF) as the learner would: a WeightSender over gloo."""

from __future__ import annotations

import asyncio
import time

import torch

from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets


def perturbed_state(model_path: str, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model.state_dict()


class Pusher:
    def __init__(self, member: str = "gtest"):
        self.sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=60)
        self.member = member

    async def join(self, engine) -> None:
        loop = asyncio.get_running_loop()
        frames = {}
        opened = loop.run_in_executor(None, self.sender.open_epoch, [f"{self.member}.0"],
                                      lambda info: frames.setdefault("epoch", schema.encode(info)),
                                      lambda *a, **k: None)
        while "epoch" not in frames:
            await asyncio.sleep(0.01)
        assert await engine.join(frames["epoch"], self.member, 60)
        assert await opened == [f"{self.member}.0"]

    async def push(self, engine, sd: dict, version: int, mode: str) -> dict:
        loop = asyncio.get_running_loop()
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], 256 * 1024)
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version,
                                        epoch=self.sender.epoch, buckets=buckets, announced_at=time.time())
        sent = loop.run_in_executor(None, self.sender.broadcast, buckets,
                                    pack_buckets(buckets, iter(sd.items()), torch.device("cpu")))
        stats = await engine.update_weights(schema.encode(ann), mode, 60)
        assert stats["checksums"] == await sent
        return stats


def switch_points(samples) -> list[tuple[int, int, int]]:
    """(index, old version, new version) where a sample's per-token versions change."""
    out = []
    for s in samples:
        for i in range(1, len(s.versions)):
            if s.versions[i] != s.versions[i - 1]:
                out.append((i, s.versions[i - 1], s.versions[i]))
    return out
