"""The weight-group protocol across real processes over gloo: join, re-form without a dead member,
bucketed transfer with checksums equal on both ends."""

import multiprocessing as mp
import os
import time

import pytest
import torch

from asyncrl.protocol.schema import SCHEMA_VERSION, WeightAnnouncement
from asyncrl.protocol.weight_sync import WeightReceiver, WeightSender, pack_buckets, plan_buckets


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


def _dies_mid_transfer(member_id, epochs, anns, up, freeze=False):
    """Joins, then after the first bucket dies as kill -9 would, or with `freeze` stops itself as
    SIGSTOP or a hung host would."""
    import signal

    recv = WeightReceiver(member_id)
    up.put(member_id)
    while not recv.join(epochs.get(timeout=60), timeout_s=30):
        pass
    ann = anns.get(timeout=60)
    for i, _ in enumerate(recv.receive(ann, torch.device("cpu"), timeout_s=30)):
        if i == 1:
            if freeze:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os._exit(9)


def test_a_member_dying_mid_transfer_fails_the_broadcast_within_the_timeout():
    from asyncrl.protocol.weight_sync import SyncTimeout

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


def _slow_member(member_id, epochs, anns, results, up, delay_s):
    recv = WeightReceiver(member_id)
    up.put(member_id)
    assert recv.join(epochs.get(timeout=60), timeout_s=20)
    for _ in range(2):
        ann = anns.get(timeout=60)
        time.sleep(delay_s)  # busy elsewhere (a loaded box, an engine still loading the last version)
        it = recv.receive(ann, torch.device("cpu"), timeout_s=20)
        got = [next(it) for b in ann.buckets for _ in b.tensors]
        received_at = time.time()  # every bucket is in; the closing all-reduce comes with the next ask
        assert next(it, None) is None
        results.put((ann.version, received_at, list(recv.checksums), len(got)))


def test_a_broadcast_returns_only_once_every_member_has_received_it():
    """A model small enough to sit in the socket buffers: without the closing all-reduce the sender's
    broadcast returned at once, it announced the next version over the first, and a member that looked
    late received the first version's bytes under the second's name (CI's elastic run)."""
    ctx = mp.get_context("spawn")
    epochs, anns, results, up = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    delay_s = 1.5
    p = ctx.Process(target=_slow_member, args=("g0", epochs, anns, results, up, delay_s))
    p.start()
    up.get(timeout=60)
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=30, sync_timeout_s=20)
    assert sender.open_epoch(["g0"], epochs.put, lambda *a, **k: None) == ["g0"]
    tensors = _tensors()
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1 << 20)
    sent = []
    for version in (1, 2):
        tensors = {n: t + 1 for n, t in tensors.items()}  # another version, other bytes
        anns.put(WeightAnnouncement(schema_version=SCHEMA_VERSION, version=version, epoch=sender.epoch,
                                    buckets=buckets, announced_at=time.time()))
        sums = sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
        sent.append((version, time.time(), sums))
    for version, returned_at, sums in sent:
        got_version, received_at, got_sums, num = results.get(timeout=60)
        assert got_version == version and got_sums == sums and num == len(tensors)
        assert returned_at >= received_at, f"version {version}: the broadcast returned before the member had it"
    p.join(timeout=30)
    assert p.exitcode == 0


def _dies_before_the_closing_all_reduce(member_id, epochs, anns, up):
    import os

    recv = WeightReceiver(member_id)
    up.put(member_id)
    assert recv.join(epochs.get(timeout=60), timeout_s=20)
    ann = anns.get(timeout=60)
    it = recv.receive(ann, torch.device("cpu"), timeout_s=20)
    for _ in range(sum(len(b.tensors) for b in ann.buckets)):
        next(it)
    os._exit(9)  # every bucket in, gone before the all-reduce


def _keeps_a_complete_version(member_id, epochs, anns, results, up):
    recv = WeightReceiver(member_id)
    up.put(member_id)
    assert recv.join(epochs.get(timeout=60), timeout_s=20)
    ann = anns.get(timeout=60)
    got = {name: t.float().sum().item() for name, t in recv.receive(ann, torch.device("cpu"), timeout_s=20)}
    results.put((got, list(recv.checksums), recv.pg is None))


def test_a_member_gone_before_the_closing_all_reduce_fails_the_sync_but_the_others_keep_the_weights():
    """Every bucket reached both members, then one died: the learner's sync fails (it cannot know
    that everyone has the version), while the survivor keeps the complete, checksummed weights
    instead of dropping them, and leaves the broken group for the next epoch."""
    from asyncrl.protocol.weight_sync import SyncTimeout

    ctx = mp.get_context("spawn")
    epochs, anns, results, up = [ctx.Queue(), ctx.Queue()], [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_keeps_a_complete_version, args=("g0", epochs[0], anns[0], results, up)),
             ctx.Process(target=_dies_before_the_closing_all_reduce, args=("g1", epochs[1], anns[1], up))]
    for p in procs:
        p.start()
    for _ in procs:
        up.get(timeout=60)
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=30, sync_timeout_s=10)

    def publish(info):
        for q in epochs:
            q.put(info)

    assert sender.open_epoch(["g0", "g1"], publish, lambda *a, **k: None) == ["g0", "g1"]
    tensors = _tensors()
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1 << 20)
    for q in anns:
        q.put(WeightAnnouncement(schema_version=SCHEMA_VERSION, version=1, epoch=sender.epoch, buckets=buckets,
                                 announced_at=time.time()))
    t0 = time.monotonic()
    with pytest.raises((SyncTimeout, RuntimeError)):
        sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
    assert time.monotonic() - t0 < 10 + 5
    got, sums, left_group = results.get(timeout=60)
    assert left_group
    assert sums == [bucket_checksum_of(b, tensors) for b in buckets]
    for name, t in tensors.items():
        assert abs(got[name] - t.float().sum().item()) < 1e-3
    procs[0].join(timeout=30)
    procs[1].join(timeout=30)
    assert (procs[0].exitcode, procs[1].exitcode) == (0, 9)


def bucket_checksum_of(bucket, tensors) -> int:
    from asyncrl.protocol.weight_sync import bucket_checksum

    (buf,) = pack_buckets([bucket], iter((m.name, tensors[m.name]) for m in bucket.tensors), torch.device("cpu"))
    return bucket_checksum(buf)


def test_packed_buckets_are_the_same_bytes_whatever_the_pool_held_before(monkeypatch):
    """Alignment gaps and padding go on the wire and into the checksum: two packings of the same weights
    must give the same bytes, or a generator still holding an earlier broadcast of a version is
    reported as a mismatch against a later one (as happens after an epoch re-forms). The pool
    buffers come out of torch.empty; here every uint8 one is dirty, as reused memory can be."""
    from asyncrl.protocol.weight_sync import bucket_checksum

    real_empty = torch.empty

    def dirty_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(0xAB) if t.dtype == torch.uint8 else t

    g = torch.Generator().manual_seed(2)
    # Odd sizes: gaps between the packed tensors (ALIGN) and padding at the end of each bucket.
    src = {"n1": torch.randn(3, generator=g), "n2": torch.randn(5, 7, generator=g).half(),
           "n3": torch.randn(13, generator=g), "cast": torch.randn(33, 3, generator=g)}
    buckets = plan_buckets([(n, torch.bfloat16 if n == "cast" else t.dtype, tuple(t.shape)) for n, t in src.items()],
                           bucket_bytes=1 << 20, direct_bytes=150)
    assert [len(b.tensors) for b in buckets] == [3, 1]
    clean = [buf.clone() for buf in pack_buckets(buckets, iter(src.items()), torch.device("cpu"))]
    monkeypatch.setattr(torch, "empty", dirty_empty)
    dirty = [buf.clone() for buf in pack_buckets(buckets, iter(src.items()), torch.device("cpu"))]
    monkeypatch.undo()
    for bucket, a, b in zip(buckets, clean, dirty, strict=True):
        assert torch.equal(a, b)
        assert bucket_checksum(a) == bucket_checksum(b)
        covered = torch.zeros(bucket.nbytes, dtype=torch.bool)
        for m in bucket.tensors:
            covered[m.offset: m.offset + m.nbytes] = True
        assert int(covered.sum()) < bucket.nbytes  # there are gaps or padding to check
        assert not b[~covered].any()


def test_bucket_checksum_is_the_wrapping_sum_of_words_on_the_numpy_and_the_torch_path():
    import struct

    from asyncrl.protocol.weight_sync import bucket_checksum

    # Words near 2**63 and 2**64 - 1: the sum wraps several times; signed and unsigned views must agree.
    words = [2**63 - 1, 2**63, 2**64 - 1, 12345, 2**62 + 7] * 9
    buf = torch.frombuffer(bytearray(struct.pack(f"<{len(words)}Q", *words)), dtype=torch.uint8)
    expected = sum(words) % 2**64
    assert bucket_checksum(buf) == expected  # the host path (numpy)
    assert int(buf.view(torch.int64).sum()) & 0xFFFFFFFFFFFFFFFF == expected  # the CUDA path's formula
    flipped = buf.clone()
    flipped[17] ^= 1
    assert bucket_checksum(flipped) != expected


def test_sampled_checksum_reads_one_word_per_page_and_catches_the_protocol_failures():
    from asyncrl.protocol.weight_sync import SAMPLE_STRIDE_WORDS, bucket_checksum, checksum_mode

    torch.manual_seed(0)
    weights = (torch.randn(4 * 2**20) * 0.02).to(torch.bfloat16)  # an 8 MiB matrix's bytes
    buf = weights.view(torch.uint8)
    words = [int(w) % 2**64 for w in buf.view(torch.int64)]
    want = (sum(words[::SAMPLE_STRIDE_WORDS]) + words[-1]) % 2**64
    assert bucket_checksum(buf, "sampled") == want  # the host path (numpy)
    v = buf.view(torch.int64)
    assert int(v[::SAMPLE_STRIDE_WORDS].sum() + v[-1]) & 0xFFFFFFFFFFFFFFFF == want  # the CUDA path's formula
    # Stale: the previous version's bytes, one small optimizer step (lr 1e-5) away in bf16.
    stepped = (weights.float() - 1e-5 * torch.randn_like(weights.float()).sign()).to(torch.bfloat16)
    assert bucket_checksum(stepped.view(torch.uint8), "sampled") != want
    truncated = buf.clone()
    truncated[-4096:] = 0  # the last page never arrived
    assert bucket_checksum(truncated, "sampled") != want
    shifted = torch.roll(buf, 64)  # tensors at the wrong offsets
    assert bucket_checksum(shifted, "sampled") != want
    # Not caught by design: a byte inside a page (the transport's own checks are for that); full is.
    flipped = buf.clone()
    flipped[100] ^= 1
    assert bucket_checksum(flipped, "sampled") == want and bucket_checksum(flipped) != bucket_checksum(buf)
    small = buf[: 2**19].clone()  # under DIRECT_BYTES (packed small tensors): summed in full
    small_flipped = small.clone()
    small_flipped[100] ^= 1
    assert bucket_checksum(small, "sampled") == bucket_checksum(small) != bucket_checksum(small_flipped, "sampled")
    from asyncrl.protocol.weight_sync import bucket_mode

    one, packed = plan_buckets([("w", torch.float32, (2**20,)), ("a", torch.float32, (8,)),
                                ("b", torch.float32, (8,))], 2**20)
    assert (bucket_mode(one, "sampled"), bucket_mode(packed, "sampled")) == ("sampled", "full")
    assert (checksum_mode("auto", "gloo"), checksum_mode("auto", "nccl"), checksum_mode("full", "gloo")) == \
        ("sampled", "full", "full")
    with pytest.raises(ValueError, match="unknown weights.checksum"):
        checksum_mode("crc", "gloo")


def _member_three_syncs(anns, results):
    """Sync 1 keeps every view (as weights.atomic does until the load), syncs 2 and 3 stream them."""
    recv = WeightReceiver("g0")
    while not recv.join(anns.get(timeout=60), timeout_s=20):
        pass
    cpu = torch.device("cpu")
    kept = list(recv.receive(anns.get(timeout=60), cpu, timeout_s=20))
    kept_sums = {name: t.double().sum().item() for name, t in kept}
    out = [(recv.checksums, kept_sums)]
    for _ in range(2):
        sums = {name: t.double().sum().item() for name, t in recv.receive(anns.get(timeout=60), cpu, timeout_s=20)}
        out.append((recv.checksums, sums))
    # Sync 1's views must still hold sync 1's values: a buffer with a live view is never received into.
    out.append({name: t.double().sum().item() for name, t in kept} == kept_sums)
    results.put(out)


def test_receive_buffer_is_reused_only_when_nothing_else_refers_to_its_storage():
    cpu = torch.device("cpu")
    recv = WeightReceiver("g0")
    a = recv._buffer(1000, cpu)
    base_a = recv._recent[-1]
    view = a[64:128].view(torch.float32)
    del a
    b = recv._buffer(800, cpu)
    assert recv._recent[-1] is not base_a, "reused while a view of it was alive"
    del view
    c = recv._buffer(800, cpu)
    assert recv._recent[-1] is base_a and c.data_ptr() == base_a.data_ptr() and c.numel() == 800
    param = torch.nn.Parameter(torch.empty(0))
    param.data = c.view(torch.float32)  # a loader that keeps the received storage as its parameter
    del b, c
    d = recv._buffer(800, cpu)
    assert d.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()
    assert recv._buffer(5000, cpu).numel() == 5000  # none large enough: a fresh one
    assert len(recv._recent) <= recv._recent.maxlen


def test_receive_reuses_only_buffers_no_view_or_broadcast_still_holds_and_values_stay_right():
    ctx = mp.get_context("spawn")
    anns, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_member_three_syncs, args=(anns, results))
    p.start()
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=20, sync_timeout_s=20)
    assert sender.open_epoch(["g0"], anns.put, lambda *a, **k: None) == ["g0"]
    names = [f"t{i}" for i in range(10)]
    # 10 buckets of one tensor each, more than PIPELINE_DEPTH in flight plus the recent pool.
    buckets = plan_buckets([(n, torch.float32, (64, 256)) for n in names], bucket_bytes=1 << 20, direct_bytes=1)
    assert len(buckets) == 10
    sent = []
    for version in (1, 2, 3):
        g = torch.Generator().manual_seed(version)
        tensors = {n: torch.randn(64, 256, generator=g) for n in names}
        anns.put(WeightAnnouncement(schema_version=SCHEMA_VERSION, version=version, epoch=sender.epoch,
                                    buckets=buckets, announced_at=time.time()))
        sums = sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
        sent.append((sums, {n: t.double().sum().item() for n, t in tensors.items()}))
    out = results.get(timeout=60)
    for (got_sums, got_values), (sums, values) in zip(out[:3], sent, strict=True):
        assert got_sums == sums
        assert got_values.keys() == values.keys()
        for n in names:
            assert abs(got_values[n] - values[n]) < 1e-6, n
    assert out[3], "a buffer that a kept view still pointed into was received into again"
    p.join(timeout=30)
    assert p.exitcode == 0


def test_a_member_whose_heartbeat_expired_is_dropped_at_once_not_at_the_join_timeout():
    """`alive` no longer lists "g9" (its heartbeat expired): the sender re-forms without it within
    about a second although the join timeout is 60 s; a member still alive keeps its place."""
    ctx = mp.get_context("spawn")
    epochs, anns, results, up = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_member, args=("g0", epochs, anns, results, up))
    p.start()
    up.get(timeout=60)
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=20)
    events = []
    t0 = time.monotonic()
    members = sender.open_epoch(["g0", "g9"], epochs.put, lambda kind, **kw: events.append(kind),
                                alive=lambda: ["g0"])
    took = time.monotonic() - t0
    assert members == ["g0"] and events == ["epoch_reform", "epoch_open"]
    assert took < 10, f"waited {took:.1f}s for a member that had left"
    tensors = _tensors()
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], bucket_bytes=1 << 20)
    anns.put(WeightAnnouncement(schema_version=SCHEMA_VERSION, version=1, epoch=sender.epoch, buckets=buckets,
                                announced_at=time.time()))
    sums = sender.broadcast(buckets, pack_buckets(buckets, iter(tensors.items()), torch.device("cpu")))
    assert results.get(timeout=60)[3] == sums
    p.join(timeout=30)


def _survives_a_dead_peer(member_id, epochs, anns, up, results):
    recv = WeightReceiver(member_id)
    up.put(member_id)
    for _ in range(2):  # the push a peer's death breaks, then the next epoch's
        while not recv.join(epochs.get(timeout=60), timeout_s=30):
            pass
        ann = anns.get(timeout=60)
        try:
            for _ in recv.receive(ann, torch.device("cpu"), timeout_s=30):
                pass
            results.put(("received", time.time(), list(recv.checksums)))
        except RuntimeError as e:
            results.put((type(e).__name__, time.time(), str(e)))
    # Its first epoch's receive is still posted inside gloo until its own timeout: a generator's
    # process ends with os._exit (generators/main.py), not by waiting for it at interpreter exit.
    results.close()
    results.join_thread()
    os._exit(0)


def test_a_member_frozen_mid_push_holds_neither_the_learner_nor_the_others_for_the_timeout():
    """A member frozen mid-push held the learner's send and every other member's receive for
    weights.sync_timeout_s. Now the learner gives the push up once the member's heartbeat is gone
    and marks the epoch given up; the others leave it at once and join the next epoch."""
    import psutil

    from asyncrl.protocol.weight_sync import SyncAbandoned

    ctx = mp.get_context("spawn")
    epochs, anns, up, results = [ctx.Queue(), ctx.Queue()], [ctx.Queue(), ctx.Queue()], ctx.Queue(), ctx.Queue()
    frozen = ctx.Process(target=_dies_mid_transfer, args=("g0", epochs[0], anns[0], up, True))
    survivor = ctx.Process(target=_survives_a_dead_peer, args=("g1", epochs[1], anns[1], up, results))
    for p in (frozen, survivor):
        p.start()
    try:
        up.get(timeout=60)
        up.get(timeout=60)
        sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=10, sync_timeout_s=30)

        def publish(info):
            for q in epochs:
                q.put(info)

        def alive():  # the fleet as the learner sees it: a stopped process's heartbeat has expired
            return [m for m, p in (("g0", frozen), ("g1", survivor))
                    if p.is_alive() and psutil.Process(p.pid).status() != psutil.STATUS_STOPPED]

        assert sender.open_epoch(["g0", "g1"], publish, lambda *a, **k: None, alive=alive) == ["g0", "g1"]
        big = {f"t{i}": torch.randn(512, 512) for i in range(16)}
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in big.items()], bucket_bytes=256 * 1024)
        ann = WeightAnnouncement(schema_version=SCHEMA_VERSION, version=1, epoch=sender.epoch, buckets=buckets,
                                 announced_at=time.time())
        for q in anns:
            q.put(ann)
        t0 = time.monotonic()
        with pytest.raises(SyncAbandoned, match="g0 left the fleet mid-push"):
            sender.broadcast(buckets, pack_buckets(buckets, iter(big.items()), torch.device("cpu")))
        assert time.monotonic() - t0 < 10, f"the learner's send was held {time.monotonic() - t0:.1f}s"
        dropped_at = time.time()
        sender.drop_group()
        kind, at, why = results.get(timeout=30)
        assert kind == SyncAbandoned.__name__ and "gave this epoch up" in why, (kind, why)
        assert at - dropped_at < 3, f"the survivor left the broken epoch {at - dropped_at:.1f}s after the learner"
        # The next epoch, without the frozen member, carries the push at once.
        t0 = time.monotonic()
        assert sender.open_epoch(["g1"], epochs[1].put, lambda *a, **k: None, alive=alive) == ["g1"]
        ann = WeightAnnouncement(schema_version=SCHEMA_VERSION, version=2, epoch=sender.epoch, buckets=buckets,
                                 announced_at=time.time())
        anns[1].put(ann)
        sums = sender.broadcast(buckets, pack_buckets(buckets, iter(big.items()), torch.device("cpu")))
        kind, _, got = results.get(timeout=60)
        assert kind == "received" and got == sums
        assert time.monotonic() - t0 < 5, f"the next epoch's push took {time.monotonic() - t0:.1f}s"
        survivor.join(timeout=30)
        assert survivor.exitcode == 0
    finally:
        for p in (frozen, survivor):
            if p.is_alive():
                p.kill()
            p.join(timeout=30)


def test_the_configs_backend_choices_are_the_transport_table():
    import typing

    from asyncrl.config import WeightsConfig
    from asyncrl.protocol.transports import TRANSPORTS

    choices = typing.get_args(WeightsConfig.model_fields["backend"].annotation)
    assert set(choices) == {"auto", *TRANSPORTS}, "a transport added to the table is also a weights.backend choice"
