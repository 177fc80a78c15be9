"""learners/reader.py over a real redis-server: FIFO, newest-first, replay ratio, the staleness
filter (counted and acked), and a redelivered group (Redis rolled back) never trained twice."""

from __future__ import annotations

from collections import Counter

from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, dedupe_append, ensure_groups, group_pending
from learners.reader import TrajectoryReader
from tests.buffer_support import buffer_cfg
from tests.helpers import make_group


def _setup(tmp_path, redis_server, *overrides, groups=()):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=rd", "learner.batch_groups=4", "learner.poll_s=0.05",
                     *overrides)
    client, keys = connect(redis_server.url), Keys("rd")
    ensure_groups(client, keys)
    pipe = client.pipeline(transaction=False)
    for gid, version in groups:
        dedupe_append(pipe, keys, gid, schema.encode(make_group(gid, version=version)))
    pipe.execute()
    return cfg, client, keys


def _ids(pairs):
    return [g.group_id for _, g in pairs]


def test_fifo_reads_in_stream_order_and_drops_stale_counted_and_acked(tmp_path, redis_server):
    groups = [("a@e0", 0), ("b@e0", 3), ("c@e0", 4), ("d@e0", 4), ("e@e0", 5), ("f@e0", 5)]
    cfg, client, keys = _setup(tmp_path, redis_server, "algorithm.max_staleness=1", groups=groups)
    reader = TrajectoryReader(client, keys, cfg)
    got, dropped = reader.read(4, version=5, in_hand=[])
    # a (lag 5) and b (lag 2) are too stale at version 5 with max_staleness 1.
    assert _ids(got) == ["c@e0", "d@e0"] and dropped == 2
    got2, _ = reader.read(4, version=5, in_hand=got)
    assert _ids(got2) == ["e@e0", "f@e0"]
    assert int(client.hget(keys.learner, "dropped_groups")) == 2
    assert group_pending(client, keys.trajectories, LEARNER_GROUP) == 4, "stale ones are acked, the rest wait"
    assert reader.read(4, version=5)[0] == []  # nothing left; returns after learner.poll_s


def test_newest_first_within_the_staleness_bound(tmp_path, redis_server):
    groups = [(f"g{i}@e0", v) for i, v in enumerate([3, 4, 5, 3, 5, 4, 2])]
    cfg, client, keys = _setup(tmp_path, redis_server, "algorithm.max_staleness=2", "buffer.sampling=newest",
                               groups=groups)
    reader = TrajectoryReader(client, keys, cfg)
    got, dropped = reader.read(3, version=5)
    assert [g.min_version() for _, g in got] == [5, 5, 4] and dropped == 1  # g6 (version 2) is too stale
    got2, _ = reader.read(3, version=5, in_hand=[])
    assert [g.min_version() for _, g in got2] == [4, 3, 3]
    # What was passed over and ages out is dropped and counted once the learner moves on.
    groups_left = reader.stats()["pool"]
    assert groups_left == 0


def test_replay_ratio_reuses_each_group_up_to_k_times_within_staleness(tmp_path, redis_server):
    groups = [(f"r{i}@e0", 5) for i in range(8)]
    cfg, client, keys = _setup(tmp_path, redis_server, "algorithm.max_staleness=1", "buffer.sampling=replay",
                               "buffer.replay_ratio=2", groups=groups)
    reader = TrajectoryReader(client, keys, cfg)
    uses = Counter()
    batches = []
    for _ in range(4):
        got, _ = reader.read(4, version=5)
        ids = _ids(got)
        assert len(ids) == len(set(ids)), "a group never appears twice in one batch"
        uses.update(ids)
        batches.append(ids)
    assert max(uses.values()) == 2 and sum(uses.values()) == 16 and len(uses) == 8
    assert sum(1 for ids in batches[1:] for i in ids if uses[i] == 2) > 0
    assert reader.stats()["replayed"] == 8
    # Past the staleness bound replayed groups leave the pool; nothing is counted as dropped for them.
    client.delete(keys.learner)
    extra = [(f"s{i}@e0", 5) for i in range(2)]
    pipe = client.pipeline(transaction=False)
    for gid, v in extra:
        dedupe_append(pipe, keys, gid, schema.encode(make_group(gid, version=v)))
    pipe.execute()
    reader.read(2, version=5)  # s0, s1 used once
    got, dropped = reader.read(4, version=7)
    assert got == [] and dropped == 0 and client.hget(keys.learner, "dropped_groups") is None


def test_a_redelivered_group_is_acked_not_trained_twice(tmp_path, redis_server):
    cfg, client, keys = _setup(tmp_path, redis_server, groups=[("x@e0", 0), ("y@e0", 0)])
    reader = TrajectoryReader(client, keys, cfg)
    got, _ = reader.read(4, version=0)
    assert _ids(got) == ["x@e0", "y@e0"]
    client.xack(keys.trajectories, LEARNER_GROUP, *[e for e, _ in got])
    # As after a redis-server restart that replayed an AOF from before the dedupe key's expiry and
    # the learner's XACK: the same group appears in the stream again.
    client.xadd(keys.trajectories, {"data": schema.encode(make_group("x@e0"))})
    got2, _ = reader.read(4, version=0)
    assert got2 == [] and reader.stats()["redelivered"] == 1
    assert group_pending(client, keys.trajectories, LEARNER_GROUP) == 0
