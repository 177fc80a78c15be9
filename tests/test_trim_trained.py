"""The trajectories stream does not grow for ever: groups the learner trained (acked) and older than
`buffer.retain_trained_s` are trimmed; undelivered and pending (delivered, not yet acked) groups stay,
and the undelivered count stays exact."""

from __future__ import annotations

from asyncrl.config import load_config
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups, group_lag, trim_trained


def _ids(client, stream):
    return [e.decode() for e, _ in client.xrange(stream)]


def test_only_acked_groups_past_the_cutoff_leave(redis_server):
    client, keys = connect(redis_server.url), Keys("trim")
    stream = keys.trajectories
    assert trim_trained(client, stream, LEARNER_GROUP, 10_000) == 0  # no stream yet
    ensure_groups(client, keys)
    for ms in range(1000, 7000, 1000):
        client.xadd(stream, {"data": b"g"}, id=f"{ms}-0")
    client.xreadgroup(LEARNER_GROUP, "learner-0", {stream: ">"}, count=4)  # 1000..4000 delivered
    client.xack(stream, LEARNER_GROUP, "1000-0", "2000-0", "4000-0")  # 3000 still pending

    assert trim_trained(client, stream, LEARNER_GROUP, 10_000) == 2  # stops at the pending 3000
    assert _ids(client, stream) == ["3000-0", "4000-0", "5000-0", "6000-0"]
    assert group_lag(client, stream, LEARNER_GROUP) == 2

    client.xack(stream, LEARNER_GROUP, "3000-0")
    assert trim_trained(client, stream, LEARNER_GROUP, 3500) == 1  # the age cutoff binds
    assert trim_trained(client, stream, LEARNER_GROUP, 10_000) == 0  # 4000 is the last delivered: kept
    assert _ids(client, stream) == ["4000-0", "5000-0", "6000-0"]
    assert group_lag(client, stream, LEARNER_GROUP) == 2
    got = client.xreadgroup(LEARNER_GROUP, "learner-0", {stream: ">"}, count=10)
    assert [e.decode() for e, _ in got[0][1]] == ["5000-0", "6000-0"]  # nothing undelivered was lost
    # A restart's recovery read of the pending entries still finds every one of them.
    pending = client.xreadgroup(LEARNER_GROUP, "learner-0", {stream: "0"}, count=10)
    assert [e.decode() for e, _ in pending[0][1]] == ["5000-0", "6000-0"]


def test_retention_is_a_checked_setting():
    assert load_config(None, []).buffer.retain_trained_s == 3600.0
    assert load_config(None, ["buffer.retain_trained_s=0"]).buffer.retain_trained_s == 0.0
    import pytest

    from asyncrl.config import ConfigError

    with pytest.raises(ConfigError, match="retain_trained_s"):
        load_config(None, ["buffer.retain_trained_s=-1"])
