"""weights.backend=ipc: the backend choice, the flat buffer's layout, the handle's wire type, and (on
CUDA) a push from a learner process to a member process through a CUDA IPC handle."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import (
    ALIGN,
    WeightReceiver,
    WeightSender,
    checksum_mode,
    choose_backend,
    flat_offsets,
    pack_buckets,
    plan_buckets,
)


def test_auto_is_gloo_on_cpu_ipc_on_one_node_and_nccl_across_nodes():
    assert choose_backend("auto", cuda=False, members_on_this_node=True) == "gloo"
    assert choose_backend("auto", cuda=True, members_on_this_node=True) == "ipc"
    assert choose_backend("auto", cuda=True, members_on_this_node=False) == "nccl"
    assert choose_backend("ipc", cuda=True, members_on_this_node=True) == "ipc"
    assert choose_backend("gloo", cuda=True, members_on_this_node=True) == "gloo"
    with pytest.raises(ValueError, match="unknown weights.backend 'shm'"):
        choose_backend("shm", cuda=True, members_on_this_node=True)
    assert checksum_mode("auto", "ipc") == "full"


def test_flat_offsets_are_aligned_and_in_order():
    metas = [("a", torch.bfloat16, (3, 5)), ("b", torch.float32, (1 << 19,)), ("c", torch.float32, (7,))]
    buckets = plan_buckets(metas, bucket_bytes=1 << 16, direct_bytes=1 << 20)
    offs = flat_offsets(buckets)
    assert len(offs) == len(buckets) + 1
    assert all(o % ALIGN == 0 for o in offs)
    for i, b in enumerate(buckets):
        assert offs[i] + b.nbytes <= offs[i + 1]


def test_the_handle_travels_as_msgpack_and_a_wrong_type_is_refused():
    export = schema.IpcExport(schema_version=schema.SCHEMA_VERSION, version=3, device_uuid="GPU-1", handle=b"\x01" * 64,
                              storage_size=4096, storage_offset=0, ref_counter_handle=b"rc", ref_counter_offset=8,
                              event_handle=b"", event_sync_required=True, nbytes=4096)
    assert schema.decode(schema.encode(export), schema.IpcExport) == export
    with pytest.raises(schema.FrameError):
        schema.decode(schema.encode(export), schema.GroupEpoch)


def test_a_cpu_member_refuses_to_join_an_ipc_epoch():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    sender = WeightSender("127.0.0.1", 0, "ipc", join_timeout_s=1.0, sync_timeout_s=5.0)
    info = schema.GroupEpoch(schema_version=schema.SCHEMA_VERSION, epoch=1, addr="127.0.0.1", port=sender.port,
                             members=["g0.0"], backend="ipc", opened_at=time.time())
    import torch.distributed as dist

    dist.PrefixStore("epoch/1", sender.store).set("decision", "go")
    with pytest.raises(RuntimeError, match="weights.backend=ipc needs CUDA"):
        WeightReceiver("g0.0").join(info, timeout_s=5.0)


def _member(frames, results):
    """A generator's side in its own process: join, receive from the handle, copy, confirm."""
    torch.cuda.set_device(0)
    receiver = WeightReceiver("g0.0")
    info = schema.decode(frames.get(timeout=60), schema.GroupEpoch)
    assert receiver.join(info, 60)
    for _ in range(2):
        ann = schema.decode(frames.get(timeout=60), schema.WeightAnnouncement)
        got = {name: t.clone() for name, t in receiver.receive(ann, torch.device("cuda"), 60)}
        receiver.finish(ann)
        results.put((ann.version, receiver.checksums, {k: float(v.float().sum()) for k, v in got.items()}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ipc_push_to_another_process_on_the_same_gpu():
    ctx = mp.get_context("spawn")
    frames, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_member, args=(frames, results), daemon=True)
    proc.start()
    try:
        torch.manual_seed(0)
        state = {"embed": torch.randn(4096, 512, device="cuda"), "norm": torch.randn(512, device="cuda"),
                 "bias": torch.randn(3, device="cuda")}
        sender = WeightSender("127.0.0.1", 0, "ipc", join_timeout_s=60, sync_timeout_s=60)
        assert sender.open_epoch(["g0.0"], lambda info: frames.put(schema.encode(info)), lambda *a, **k: None) == ["g0.0"]
        buckets = plan_buckets([(k, torch.bfloat16, tuple(v.shape)) for k, v in state.items()], 1 << 20)
        for version in (1, 2):
            for t in state.values():
                t.add_(1.0)
            ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=version, epoch=sender.epoch,
                                            buckets=buckets, announced_at=time.time())
            frames.put(schema.encode(ann))
            sums = sender.broadcast(buckets, pack_buckets(buckets, iter(state.items()), torch.device("cuda")),
                                    "full", version=version)
            got_version, got_sums, got = results.get(timeout=60)
            assert got_version == version and got_sums == sums
            for k, v in state.items():
                assert got[k] == pytest.approx(float(v.to(torch.bfloat16).float().sum()), rel=1e-6)
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
