"""The dedupe window is bounded and exactly-once still holds: a group carries its prompt's lease, the
buffer stores it only while that lease is pending and acks it in the same step, so the `seen:` key
can expire (after buffer.lease_timeout_s + buffer.redis_retry_s) and a copy arriving after that, or
after the prompt was reclaimed and re-released, is still refused. Real redis-server, a real buffer
service and real ZeroMQ pushes."""

from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys
from asyncrl.protocol.store import SEEN_TTL_S, seen_ttl_s
from tests.buffer_support import buffer_cfg, push, start_thread, stream_group_ids, wait_for
from tests.helpers import make_group


def _lease(client, keys, consumer, count=1):
    reply = client.xreadgroup(PROMPT_GROUP, consumer, {keys.prompts: ">"}, count=count, block=2000)
    return [(entry_id, schema.decode(f[b"data"], schema.PromptTask).group_id) for entry_id, f in reply[0][1]]


def _frame(gid, entry_id):
    return schema.encode(make_group(gid, lease_id=entry_id.decode() if entry_id else ""))


def test_a_stored_group_is_refused_after_its_window_and_after_a_reclaim(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=window", "learner.batch_groups=4",
                     "buffer.lease_timeout_s=1", "buffer.redis_retry_s=1")
    svc, t = start_thread(cfg)
    client, keys = svc.client, Keys("window")
    try:
        assert wait_for(lambda: client.xlen(keys.prompts) >= 3, 10)
        # Stored with its lease, which the same step acks; the dedupe key lives lease + retry horizon.
        ((entry, gid),) = _lease(client, keys, "g-a")
        push(svc.ingest_addr, [_frame(gid, entry)])
        assert wait_for(lambda: stream_group_ids(client, keys) == [gid], 10)
        assert client.xpending(keys.prompts, PROMPT_GROUP)["pending"] == 0
        assert 0 < client.ttl(keys.seen(gid)) <= seen_ttl_s(1, 1) == 3
        # Past the window the key is gone (real expiry), and a late copy is still refused: no lease.
        assert wait_for(lambda: not client.exists(keys.seen(gid)), 10)
        push(svc.ingest_addr, [_frame(gid, entry)])
        assert wait_for(lambda: svc.counters.get("reject:lease_gone", 0) == 1, 10)
        assert stream_group_ids(client, keys) == [gid]

        # A generator that froze holding a lease: the prompt is reclaimed and re-released; its late
        # copy is refused, the re-released one is stored, once.
        ((old_entry, gid2),) = _lease(client, keys, "g-frozen")
        assert wait_for(lambda: svc.counters.get("reclaims", 0) >= 1, 15)
        again = dict((g, e) for e, g in _lease(client, keys, "g-b", count=10))
        assert gid2 in again and again[gid2] != old_entry
        push(svc.ingest_addr, [_frame(gid2, old_entry)])
        assert wait_for(lambda: svc.counters.get("reject:lease_gone", 0) == 2, 10)
        push(svc.ingest_addr, [_frame(gid2, again[gid2]), _frame(gid2, again[gid2])])
        assert wait_for(lambda: stream_group_ids(client, keys) == [gid, gid2], 10)
        assert wait_for(lambda: svc.counters.get("dedupes", 0) == 1, 10)
        assert stream_group_ids(client, keys) == [gid, gid2]

        # A frame naming no lease (an older writer) is deduped by its key alone, kept long.
        push(svc.ingest_addr, [_frame("lone@e0", None)])
        assert wait_for(lambda: client.exists(keys.seen("lone@e0")), 10)
        assert client.ttl(keys.seen("lone@e0")) > SEEN_TTL_S - 60
    finally:
        svc.stop()
        t.join(timeout=10)


def test_a_malformed_lease_id_is_refused_with_its_reason(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=badlease")
    svc, t = start_thread(cfg)
    try:
        push(svc.ingest_addr, [schema.encode(make_group("p0@e0", lease_id="0-0 or 1"))])
        assert wait_for(lambda: svc.counters.get("reject:bad_lease_id", 0) == 1, 10)
        assert svc.client.xlen(svc.keys.trajectories) == 0
    finally:
        svc.stop()
        t.join(timeout=10)


def test_the_outbox_lets_a_group_go_once_its_lease_is_gone(redis_server):
    """A generator frozen past the dedupe window finds no `seen:` key, but its lease is gone (stored or
    reclaimed): the real outbox drops the frame at the next renewal instead of holding it."""
    import asyncio

    from asyncrl.protocol.keys import aconnect, connect
    from asyncrl.protocol.store import ensure_groups
    from generators.outbox import GroupOutbox

    client, keys = connect(redis_server.url), Keys("outbox-lease")
    ensure_groups(client, keys)
    client.xadd(keys.prompts, {"data": b"x"})
    client.xadd(keys.prompts, {"data": b"y"})
    (gone, held) = [e for e, _ in client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=2)[0][1]]
    client.set(keys.ingest_addr, b"tcp://127.0.0.1:1")

    async def go():
        r = await aconnect(redis_server.url)
        box = GroupOutbox(r, keys, "g0", lease_timeout_s=0.3, poll_s=0.05)
        await box.connect(timeout_s=5)
        box.put("a@e0", gone, b"frame-a")
        box.put("b@e0", held, b"frame-b")
        client.xack(keys.prompts, PROMPT_GROUP, gone)  # what the buffer's store step does
        client.hset(keys.metrics, "buffer:full", 1)  # a full buffer: the other group is held, renewed
        await asyncio.sleep(0.15)
        await box.check()
        box.close()
        await r.aclose()
        return box

    box = asyncio.run(go())
    assert list(box.held) == ["b@e0"] and box.num_lease_gone == 1
