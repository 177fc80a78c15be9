"""Every generator the run has seen stays in `asyncrl status` (asyncrl/protocol/members.py) until it
leaves cleanly or its leases are reclaimed: live, stalled (heartbeat late, e.g. SIGSTOP) or gone
(heartbeat key expired). Real redis-server; the end-to-end test freezes a real generator process
started by hand (no launcher) and reads `asyncrl status --once --json`."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.protocol import members
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect
from asyncrl.protocol.store import ensure_groups
from tests.buffer_support import wait_for
from tests.test_generator_process import _gen_info, _learner_side


def _member(client, keys, gid, updated_at, live=True, ttl_s=10):
    client.hset(keys.members, gid, members.summary({"state": "generating", "version": 3, "groups": 7, "pid": 1,
                                                    "host": "elsewhere", "updated_at": updated_at},
                                                   f"p{gid}@e0", updated_at))
    if live:
        client.hset(keys.gen(gid), mapping={"id": gid, "updated_at": updated_at})
        client.expire(keys.gen(gid), ttl_s)


def test_members_are_live_stalled_or_gone_and_pruned_only_without_leases(redis_server):
    client, keys = connect(redis_server.url), Keys("members")
    ensure_groups(client, keys)
    now = time.time()
    _member(client, keys, "g0", now)  # beating
    _member(client, keys, "g1", now - 5)  # key still there, 5 s without a beat: stalled
    _member(client, keys, "g2", now - 100, live=False)  # key expired, holds a lease: gone, kept
    _member(client, keys, "g3", now - 100, live=False)  # key expired, no lease: gone, then forgotten
    _member(client, keys, "g4", now - 5, live=False)  # key expired lately, no lease: kept for now
    client.xadd(keys.prompts, {"data": b"x"})
    client.xreadgroup(PROMPT_GROUP, "g2", {keys.prompts: ">"}, count=1)
    view = {m["id"]: m for m in members.read_members(client, keys, 1.0, 10.0, now)}
    assert {g: m["state"] for g, m in view.items()} == {"g0": "live", "g1": "stalled", "g2": "gone",
                                                       "g3": "gone", "g4": "gone"}
    assert view["g2"]["leases"] == 1 and view["g0"]["leases"] == 0
    assert view["g2"]["last_group"] == "pg2@e0" and view["g2"]["heartbeat_age_s"] == pytest.approx(100, abs=1)
    assert members.prune(client, keys, lease_timeout_s=60, now=now) == ["g3"]
    assert sorted(k.decode() for k in client.hgetall(keys.members)) == ["g0", "g1", "g2", "g4"]
    # Once its lease is acked (reclaimed), the dead member is forgotten too.
    (entry_id,) = [e for e, _ in client.xrange(keys.prompts)]
    client.xack(keys.prompts, PROMPT_GROUP, entry_id)
    assert members.prune(client, keys, lease_timeout_s=60, now=now) == ["g2"]


def test_stalled_is_named_before_the_heartbeat_key_expires():
    assert members.stale_after_s(1.0, 10.0) == 3.0
    assert members.stale_after_s(5.0, 10.0) == 8.0  # always inside the key's lifetime


def _status(cfg_path, url):
    out = subprocess.run([sys.executable, "-m", "asyncrl", "status", str(cfg_path), "--redis", url, "--once",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return {m["id"]: m for m in json.loads(out.stdout)["members"]}


@pytest.mark.slow
def test_a_frozen_generator_started_by_hand_stays_in_status(make_cfg, redis_server, tmp_path):
    """SIGSTOP: stalled (the process named stopped) within the heartbeat TTL, still listed as gone once
    the key expired; SIGCONT: live again; SIGTERM: it leaves cleanly and status forgets it."""
    cfg_path, keys, client, buffer, procs = _learner_side(
        make_cfg, redis_server, tmp_path, "members-e2e", "generator.backend=hf", "generator.heartbeat_ttl_s=6",
        "generator.drain_timeout_s=0", "buffer.lease_timeout_s=60")
    proc = procs.spawn("g0", [sys.executable, "-m", "asyncrl", "generator", str(cfg_path), "--id", "g0"])
    try:
        assert wait_for(lambda: _gen_info(client, keys, "g0").get("state") == "waiting_weights", 180, 0.2), \
            procs.log("g0")[-3000:]
        assert _status(cfg_path, redis_server.url)["g0"]["state"] == "live"
        os.kill(proc.pid, signal.SIGSTOP)
        frozen_at = time.time()
        assert wait_for(lambda: _status(cfg_path, redis_server.url)["g0"]["state"] == "stalled", 6, 0.2)
        named_s = time.time() - frozen_at
        g0 = _status(cfg_path, redis_server.url)["g0"]
        assert named_s < 6 and g0["process"].endswith("is stopped (SIGSTOP)"), (named_s, g0)
        assert wait_for(lambda: not client.exists(keys.gen("g0")), 15, 0.2)
        g0 = _status(cfg_path, redis_server.url)["g0"]
        assert g0["state"] == "gone" and g0["heartbeat_age_s"] >= 6, g0
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_for(lambda: _status(cfg_path, redis_server.url)["g0"]["state"] == "live", 15, 0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, procs.log("g0")[-3000:]
        assert "g0" not in _status(cfg_path, redis_server.url)
    finally:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        procs.close()
        buffer.stop()
