"""A learner that died between a complete checkpoint and the ack of its trajectories does not train
them again on resume: the checkpoint's meta.json names them, and the resume acks them before the
recovery path reads what is still pending."""

from __future__ import annotations

import json

from asyncrl.protocol import schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys, connect
from asyncrl.protocol.store import ensure_groups
from learners.feed import Feed, ack_checkpointed
from learners.fleet import Fleet
from tests.helpers import fixed_groups


def test_resume_acks_the_checkpoints_entries_and_re_trains_only_the_rest(make_cfg, redis_server, tmp_path):
    cfg = make_cfg("run.name=ckacks", redis=redis_server)
    client, keys = connect(redis_server.url), Keys("ckacks")
    ensure_groups(client, keys)
    groups = fixed_groups(6)
    for g in groups:
        client.xadd(keys.trajectories, {"data": schema.encode(g)})
    delivered = client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"}, count=10)[0][1]
    entries = [e for e, _ in delivered]
    # The dead learner had trained the first four into a complete checkpoint, then died before acking them.
    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 2, "version": 2,
                                                "acked_entries": [e.decode() for e in entries[:4]]}))

    assert ack_checkpointed(client, keys, ckpt) == 4
    assert ack_checkpointed(client, keys, ckpt) == 0  # a second resume of the same checkpoint: nothing left
    assert int(client.xpending(keys.trajectories, LEARNER_GROUP)["pending"]) == 2
    feed = Feed(cfg, client, keys, Fleet(cfg, client, keys), vocab_size=128, version=2)
    assert [g.group_id for _, g in feed.pending] == [g.group_id for g in groups[4:]]
    kinds = [f[b"kind"] for _, f in client.xrange(keys.events)]
    assert kinds.count(b"ack_checkpointed") == 1


def test_a_checkpoint_without_the_list_acks_nothing(redis_server, tmp_path):
    client, keys = connect(redis_server.url), Keys("old")
    ensure_groups(client, keys)
    ckpt = tmp_path / "step-000001"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "version": 1}))  # written before the list existed
    assert ack_checkpointed(client, keys, ckpt) == 0
