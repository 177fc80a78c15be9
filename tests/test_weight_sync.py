"""The weight-group protocol across real processes over gloo: join, re-form without a dead member,
bucketed transfer with checksums equal on both ends."""

import multiprocessing as mp
import time

import torch

from asyncrl.schema import SCHEMA_VERSION, WeightAnnouncement
from asyncrl.weight_sync import WeightReceiver, WeightSender, pack_buckets, plan_buckets


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=g),
        "b.bias": torch.randn(7, generator=g),
        "c.weight": torch.randn(300, 300, generator=g).to(torch.bfloat16),
    }


def _member(member_id, epochs, anns, results, up):
    recv = WeightReceiver(member_id)
    up.put(member_id)
    while True:
        info = epochs.get(timeout=60)
        if recv.join(info, timeout_s=20):
            break
    ann = anns.get(timeout=60)
    got = {name: t.clone() for name, t in recv.receive(ann, torch.device("cpu"), timeout_s=20)}
    results.put((member_id, info.epoch, {k: v.float().sum().item() for k, v in got.items()}, recv.checksums))


def test_group_forms_without_a_dead_member_and_transfers_buckets():
    ctx = mp.get_context("spawn")
    epochs = [ctx.Queue(), ctx.Queue()]
    anns = [ctx.Queue(), ctx.Queue()]
    results, up = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_member, args=(f"g{i}", epochs[i], anns[i], results, up)) for i in range(2)]
    for p in procs:
        p.start()
    for _ in procs:
        up.get(timeout=60)
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=3, sync_timeout_s=20)
    events = []

    def publish(info):
        for q in epochs:
            q.put(info)

    t0 = time.monotonic()
    # "g9" never shows up: the sender must drop it within the join timeout and re-form.
    members = sender.open_epoch(["g0", "g1", "g9"], publish, lambda kind, **kw: events.append(kind))
    assert members == ["g0", "g1"]
    assert events == ["epoch_reform", "epoch_open"]
    assert time.monotonic() - t0 < 15

    tensors = _tensors()
    # c.weight (176 KiB) goes in a direct bucket of its own, sent from its storage; a and b are packed.
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=64 * 1024,
                           direct_bytes=100_000)
    assert [len(b.tensors) for b in buckets] == [2, 1], "the test wants a packed and a direct bucket"
    ann = WeightAnnouncement(schema_version=SCHEMA_VERSION, version=3, epoch=sender.epoch, buckets=buckets,
                             announced_at=time.time())
    for q in anns:
        q.put(ann)
    sums = sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
    for _ in range(2):
        member_id, epoch, got, checksums = results.get(timeout=60)
        assert epoch == sender.epoch
        assert checksums == sums
        for name, t in tensors.items():
            assert abs(got[name] - t.float().sum().item()) < 1e-3
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0


def _dies_mid_transfer(member_id, epochs, anns, up):
    import os

    recv = WeightReceiver(member_id)
    up.put(member_id)
    while not recv.join(epochs.get(timeout=60), timeout_s=20):
        pass
    ann = anns.get(timeout=60)
    for i, _ in enumerate(recv.receive(ann, torch.device("cpu"), timeout_s=20)):
        if i == 1:  # first bucket received: now die like kill -9 would
            os._exit(9)


def test_a_member_dying_mid_transfer_fails_the_broadcast_within_the_timeout():
    from asyncrl.weight_sync import SyncTimeout

    ctx = mp.get_context("spawn")
    epochs, anns, up = ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_dies_mid_transfer, args=("g0", epochs, anns, up))
    p.start()
    up.get(timeout=60)
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=10, sync_timeout_s=5)
    assert sender.open_epoch(["g0"], epochs.put, lambda *a, **k: None) == ["g0"]
    big = {f"t{i}": torch.randn(256, 256) for i in range(8)}
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in big.items()], bucket_bytes=256 * 1024)
    anns.put(WeightAnnouncement(schema_version=SCHEMA_VERSION, version=1, epoch=sender.epoch, buckets=buckets,
                                announced_at=time.time()))
    t0 = time.monotonic()
    try:
        sender.broadcast(buckets, pack_buckets(buckets, iter(big.items()), torch.device("cpu")))
        raised = None
    except (SyncTimeout, RuntimeError) as e:
        raised = e
    assert raised is not None, "a dead member must fail the broadcast, not hang it"
    assert time.monotonic() - t0 < 5 + 10
    p.join(timeout=30)
    assert p.exitcode == 9


def test_pack_sends_matching_tensors_from_their_own_storage_and_casts_the_rest_in_one_copy():
    g = torch.Generator().manual_seed(1)
    src = {"small.a": torch.randn(5, 3, generator=g), "small.b": torch.randn(11, generator=g),
           "big.same": torch.randn(64, 64, generator=g), "big.cast": torch.randn(64, 64, generator=g),
           "big.strided": torch.randn(64, 64, generator=g).t(), "big.odd": torch.randn(4099, generator=g).half()}
    planned = {n: (torch.bfloat16 if n == "big.cast" else t.dtype) for n, t in src.items()}
    buckets = plan_buckets([(n, planned[n], tuple(t.shape)) for n, t in src.items()], bucket_bytes=1 << 20,
                           direct_bytes=8000)
    assert [[m.name for m in b.tensors] for b in buckets] == [
        ["small.a", "small.b"], ["big.same"], ["big.cast"], ["big.strided"], ["big.odd"]]
    bufs = [buf.clone() for buf in pack_buckets(buckets, iter(src.items()), torch.device("cpu"))]
    # Only a contiguous tensor of the planned dtype that fills its (8-byte padded) bucket goes uncopied.
    direct = [buf.data_ptr() == src[b.tensors[0].name].data_ptr() for b, buf in zip(buckets, pack_buckets(
        buckets, iter(src.items()), torch.device("cpu")), strict=True) if len(b.tensors) == 1]
    assert direct == [True, False, False, False]
    for bucket, buf in zip(buckets, bufs, strict=True):
        assert buf.numel() == bucket.nbytes and bucket.nbytes % 8 == 0
        for m in bucket.tensors:
            got = buf[m.offset: m.offset + m.nbytes].view(planned[m.name]).view(m.shape)
            assert torch.equal(got, src[m.name].to(planned[m.name])), m.name
