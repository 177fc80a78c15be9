"""A consumer group's undelivered count survives a Redis whose `lag` counter came back wrong.

After a redis-server restart from its AOF, XINFO GROUPS reported lag 1394 on the prompts stream with
every entry delivered; the buffer read that as its prompt backlog and never released a prompt again.
`group_lag` reads 0 whenever the group has been delivered the stream's last entry, and sets the
counter right, so the lag is exact again for the entries that follow."""

from __future__ import annotations

from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import PROMPT_GROUP, ensure_groups, group_lag


def test_lag_is_zero_once_everything_is_delivered_whatever_the_counter_says(redis_server):
    client, keys = connect(redis_server.url), Keys("lag")
    ensure_groups(client, keys)
    for i in range(5):
        client.xadd(keys.prompts, {"data": b"p%d" % i})
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 5
    client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=10)
    last = client.xinfo_stream(keys.prompts)["last-generated-id"]
    # The state the restarted server came back in: everything delivered, entries-read behind.
    client.xgroup_setid(keys.prompts, PROMPT_GROUP, last, entries_read=1)
    assert client.xinfo_groups(keys.prompts)[0]["lag"] == 4

    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 0
    assert client.xinfo_groups(keys.prompts)[0]["lag"] == 0  # the counter is right again
    assert client.xinfo_groups(keys.prompts)[0]["last-delivered-id"] == last  # nothing re-delivered
    client.xadd(keys.prompts, {"data": b"p5"})
    client.xadd(keys.prompts, {"data": b"p6"})
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 2
    client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=1)
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 1


def test_no_stream_or_no_group_has_nothing_undelivered(redis_server):
    client, keys = connect(redis_server.url), Keys("none")
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 0
    ensure_groups(client, keys)
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 0
    assert group_lag(client, keys.prompts, "nobody") == 0
