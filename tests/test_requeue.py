"""A group the learner drops unused (too stale, or sampled ahead of a resumed learner) wastes no prompt:
its prompt goes back on the requeue list with the ack, the buffer releases it again before any new one
(same group id, against the admission budget), the new group is stored despite the old one's dedupe key,
a late copy of the old group is refused by its lease, and the prompt is trained once; a resumed
learner sends back the prompts of groups sampled ahead of its checkpoint. Real redis-server,
the learner's real reader and the buffer's real prompt release and dedupe script."""

from __future__ import annotations

from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, dedupe_append, ensure_groups, group_pending, seen_ttl_s
from asyncrl.tasks.base import PromptRecord
from buffers.gauges import Counters
from buffers.prompts import PromptFeed
from learners.reader import TrajectoryReader
from tests.buffer_support import buffer_cfg
from tests.helpers import make_group

ROWS = [PromptRecord(prompt_id=f"q{i}", prompt=f"what is {i} + 1?", answer=str(i + 1)) for i in range(40)]


def _lease(client, keys, count: int) -> list[schema.PromptTask]:
    """What a generator does: XREADGROUP prompts, each task with its lease (entry id)."""
    reply = client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=count)
    out = []
    for entry_id, fields in reply[0][1] if reply else []:
        out.append((entry_id.decode(), schema.decode(fields[b"data"], schema.PromptTask)))
    return out


def _store(client, keys, ttl, pairs) -> list[int]:
    """What the buffer's ingest does with each group: the atomic dedupe + lease ack + append."""
    pipe = client.pipeline(transaction=False)
    for lease_id, gid, version in pairs:
        group = make_group(gid, version=version, lease_id=lease_id)
        dedupe_append(pipe, keys, gid, schema.encode(group), lease_id, ttl)
    return [int(r) for r in pipe.execute()]


def test_dropped_groups_prompts_are_released_again_and_trained_once(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=rq", "learner.batch_groups=2", "learner.poll_s=0.05",
                     "algorithm.max_staleness=1")
    client, keys = connect(redis_server.url), Keys("rq")
    ensure_groups(client, keys)
    client.hset(keys.cursor, mapping={"epoch": 0, "index": 0, "released": 0})
    client.set(keys.version, 3)
    counters = Counters()
    feed = PromptFeed(cfg, client, keys, ROWS, counters)
    assert feed.release() == (3 + 1 + 1) * 2  # the admission budget at version 3
    ttl = seen_ttl_s(cfg.buffer.lease_timeout_s, cfg.buffer.redis_retry_s)
    leased = _lease(client, keys, 3)
    # Sampled at version 1 (too stale at 3), 5 (ahead: weights a resumed learner at 3 no longer has), 3.
    first = [(lease, task.group_id, v) for (lease, task), v in zip(leased, (1, 5, 3), strict=True)]
    assert _store(client, keys, ttl, first) == [1, 1, 1]
    stale_id, ahead_id, good_id = (gid for _, gid, _ in first)

    reader = TrajectoryReader(client, keys, cfg)
    trained = []
    dropped = 0
    for _ in range(2):
        got, num = reader.read(2, version=3)
        trained, dropped = trained + [g.group_id for _, g in got], dropped + num
    assert trained == [good_id] and dropped == 2
    assert [g.decode() for g in client.lrange(keys.requeue, 0, -1)] == [stale_id, ahead_id]
    learner = {k.decode(): int(v) for k, v in client.hgetall(keys.learner).items()}
    assert learner["requeued_stale"] == 1 and learner["requeued_ahead"] == 1 and learner["dropped_groups"] == 2
    assert reader.stats()["requeued_stale"] == 1 and reader.stats()["requeued_ahead"] == 1
    assert group_pending(client, keys.trajectories, LEARNER_GROUP) == 1  # the dropped two are acked

    # The two dropped groups gave their slots back; the buffer fills them with their own prompts first.
    released = int(client.hget(keys.cursor, "released"))
    assert feed.release() == 2 and counters["requeues"] == 2
    assert client.llen(keys.requeue) == 0 and int(client.hget(keys.cursor, "released")) == released + 2
    rest = _lease(client, keys, 100)
    again = [(lease, task) for lease, task in rest if task.group_id in (stale_id, ahead_id)]
    assert [t.group_id for _, t in again] == [stale_id, ahead_id]
    by_id = {r.prompt_id: r for r in ROWS}
    assert all(t.prompt == by_id[t.prompt_id].prompt and t.answer == by_id[t.prompt_id].answer for _, t in again)

    # Their new groups are stored although the old ones' dedupe keys had not expired; a late copy of an
    # old group is refused by its lease, acked when it was stored.
    assert _store(client, keys, ttl, [(first[0][0], stale_id, 1)]) == [-1]
    assert _store(client, keys, ttl, [(lease, t.group_id, 3) for lease, t in again]) == [1, 1]
    assert _store(client, keys, ttl, [(first[0][0], stale_id, 1)]) == [0]
    assert _store(client, keys, ttl, [(lease, t.group_id, 3) for lease, t in again]) == [0, 0]  # a retry

    for _ in range(3):
        got, dropped = reader.read(2, version=3)
        trained += [g.group_id for _, g in got]
        assert dropped == 0
    assert sorted(trained) == sorted([good_id, stale_id, ahead_id]), "each prompt trained once"
    assert client.llen(keys.requeue) == 0


def test_a_retried_drop_neither_requeues_nor_counts_twice_and_a_leaseless_group_is_only_dropped(redis_server):
    from learners.reader import requeue_dropped

    client, keys = connect(redis_server.url), Keys("rq2")
    ensure_groups(client, keys)
    _store(client, keys, 60, [("", "p0@e0", 0)])  # an older writer's group: no lease
    entry_id, fields = client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"}, count=1)[0][1][0]
    group = schema.decode(fields[b"data"], schema.TrajectoryGroup)
    assert requeue_dropped(client, keys, [(entry_id, group)], "stale") == (1, 0), "no lease: dropped only"
    leased = make_group("p0@e0", lease_id="1-0")
    assert requeue_dropped(client, keys, [(entry_id, leased)], "stale") == (0, 0), "already acked: nothing"
    assert client.llen(keys.requeue) == 0 and int(client.hget(keys.learner, "dropped_groups")) == 1


def test_a_resumed_learner_sends_back_the_prompts_of_groups_sampled_ahead_of_its_checkpoint(make_cfg,
                                                                                          redis_server):
    import msgspec

    from learners.feed import Feed
    from learners.fleet import Fleet
    from tests.helpers import fixed_groups

    cfg = make_cfg("run.name=rqres", redis=redis_server)
    client, keys = connect(redis_server.url), Keys("rqres")
    ensure_groups(client, keys)
    groups = []
    for i, g in enumerate(fixed_groups(4)):  # sampled at versions 1, 2, 3, 4, each under its prompt's lease
        v = i + 1
        samples = [msgspec.structs.replace(s, versions=schema.pack_i32([v] * s.num_tokens)) for s in g.samples]
        groups.append(msgspec.structs.replace(g, samples=samples, lease_id=f"{100 + i}-0"))
        client.xadd(keys.trajectories, {"data": schema.encode(groups[-1])})
    # The learner that read them died; its checkpoint is at version 2: groups at 3 and 4 are ahead.
    client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"}, count=10)
    feed = Feed(cfg, client, keys, Fleet(cfg, client, keys), vocab_size=128, version=2)
    assert [g.group_id for _, g in feed.pending] == ["p0@e0", "p1@e0"]
    assert [g.decode() for g in client.lrange(keys.requeue, 0, -1)] == ["p2@e0", "p3@e0"]
    assert feed.requeued_ahead == 2 and int(client.hget(keys.learner, "requeued_ahead")) == 2
    assert group_pending(client, keys.trajectories, LEARNER_GROUP) == 2  # the two to train again
