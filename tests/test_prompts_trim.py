"""Redis stays flat on long runs: prompts whose lease is over (their group stored, or reclaimed) leave
the prompts stream with the trained groups, past buffer.retain_trained_s; leased and undelivered
prompts stay. Real redis-server, the buffer's real gauges."""

from asyncrl.config import load_config
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect
from asyncrl.protocol.store import ensure_groups, group_lag
from buffers.gauges import Counters, Gauges


def test_prompts_past_their_lease_are_trimmed_and_leased_ones_stay(tmp_path, redis_server):
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=ptrim", f"buffer.redis_url={redis_server.url}",
                             "buffer.retain_trained_s=60"])
    client, keys = connect(redis_server.url), Keys("ptrim")
    ensure_groups(client, keys)
    for ms in range(1000, 6000, 1000):
        client.xadd(keys.prompts, {"data": b"p"}, id=f"{ms}-0")
    client.xreadgroup(PROMPT_GROUP, "g0", {keys.prompts: ">"}, count=4)  # 1000..4000 leased
    client.xack(keys.prompts, PROMPT_GROUP, "1000-0", "2000-0", "4000-0")  # 3000 still leased
    gauges = Gauges(cfg, client, keys, Counters(), "i")
    gauges.trim(server_now_s=1000.0)  # everything is older than 60 s by then
    assert [e.decode() for e, _ in client.xrange(keys.prompts)] == ["3000-0", "4000-0", "5000-0"]
    assert gauges.counters["prompts_trimmed"] == 2
    assert group_lag(client, keys.prompts, PROMPT_GROUP) == 1  # the undelivered prompt is still to lease
    client.xack(keys.prompts, PROMPT_GROUP, "3000-0")
    gauges.trim(server_now_s=1000.0)
    assert [e.decode() for e, _ in client.xrange(keys.prompts)] == ["4000-0", "5000-0"]  # last delivered kept
    got = client.xreadgroup(PROMPT_GROUP, "g1", {keys.prompts: ">"}, count=10)
    assert [e.decode() for e, _ in got[0][1]] == ["5000-0"]
