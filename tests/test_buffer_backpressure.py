"""Backpressure and leases over a real redis-server and real ZeroMQ sockets: a full buffer stops
pulling and drops nothing; a lease holder killed with -9 loses no prompt; a late duplicate lands once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import zmq

from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys
from asyncrl.protocol.store import LEARNER_GROUP, group_lag
from tests.buffer_support import REPO, buffer_cfg, push, start_thread, stream_group_ids, wait_for
from tests.helpers import make_group


def _metric(svc, name):
    v = svc.client.hget(svc.keys.metrics, f"buffer:{name}")
    return None if v is None else float(v)


def test_full_buffer_stops_ingest_and_drops_nothing(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=full", "buffer.capacity=5")
    svc, t = start_thread(cfg)
    keys = Keys("full")
    try:
        gids = [f"p{i}@e0" for i in range(40)]
        push(svc.ingest_addr, [schema.encode(make_group(g)) for g in gids])
        # No learner reads: exactly `capacity` groups are appended, the rest wait in ZeroMQ.
        assert wait_for(lambda: svc.client.xlen(keys.trajectories) == 5)
        assert wait_for(lambda: _metric(svc, "full") == 1.0, 5)
        assert svc.client.xlen(keys.trajectories) == 5
        assert _metric(svc, "depth") == 5 and _metric(svc, "full_pauses") >= 1
        assert _metric(svc, "oldest_age_s") >= 0 and _metric(svc, "capacity") == 5
        # A learner drains it: every group arrives, once, none rejected or dropped.
        seen = []
        def consume():
            reply = svc.client.xreadgroup(LEARNER_GROUP, "l0", {keys.trajectories: ">"}, count=3)
            for entry_id, fields in reply[0][1] if reply else []:
                seen.append(schema.decode(fields[b"data"], schema.TrajectoryGroup).group_id)
                svc.client.xack(keys.trajectories, LEARNER_GROUP, entry_id)
                # never more than capacity undelivered, at any moment
                assert group_lag(svc.client, keys.trajectories, LEARNER_GROUP) <= 5
            return len(seen) == 40
        assert wait_for(consume, 30)
        assert sorted(seen) == sorted(gids)
        assert not any(k.startswith("reject:") for k in svc.counters) and svc.counters["dedupes"] == 0
        assert wait_for(lambda: _metric(svc, "full") == 0.0, 5)
        assert _metric(svc, "full_ms") > 0
        assert _metric(svc, "groups") == 40 and _metric(svc, "groups_per_s") is not None
        assert _metric(svc, "bytes") == sum(len(schema.encode(make_group(g))) for g in gids)
    finally:
        svc.stop()
        t.join(10)


def test_full_buffer_holds_the_senders_at_the_high_water_mark(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=hwm", "buffer.capacity=2", "generator.max_tokens=8192",
                    "generator.max_model_len=8200")
    svc, t = start_thread(cfg)
    try:
        frame = schema.encode(make_group("big@e0", num_samples=8, num_tokens=8192))  # ~790 kB
        s = zmq.Context.instance().socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, 4)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(svc.ingest_addr)
        sent, held = 0, False
        for i in range(2000):
            try:
                s.send(schema.encode(make_group(f"big{i}@e0", num_samples=8, num_tokens=8192)), zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                time.sleep(0.3)  # give the pipes a moment, then try once more
                try:
                    s.send(frame, zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    held = True
                    break
        assert held, f"the sender was never held back ({sent} frames accepted)"
        assert sent < 2000
        assert wait_for(lambda: svc.client.xlen(svc.keys.trajectories) == 2)
        s.close(0)
    finally:
        svc.stop()
        t.join(10)


LEASE_HOLDER = """
import sys, time, redis
from asyncrl.protocol.keys import Keys, PROMPT_GROUP
k = Keys(sys.argv[2]); r = redis.Redis.from_url(sys.argv[1])
got = r.xreadgroup(PROMPT_GROUP, "doomed-gen", {k.prompts: ">"}, count=3, block=5000)
print(len(got[0][1]), flush=True)
time.sleep(600)
"""


def test_kill9_of_a_lease_holder_loses_no_prompt_and_late_duplicate_lands_once(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=lease", "learner.batch_groups=2",
                     "buffer.lease_timeout_s=1.0")
    svc, t = start_thread(cfg)
    keys = Keys("lease")
    try:
        assert wait_for(lambda: svc.client.xlen(keys.prompts) == 4)
        holder = subprocess.Popen([sys.executable, "-c", LEASE_HOLDER, redis_server.url, "lease"], cwd=REPO,
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert holder.stdout.readline().strip() == "3"
        pend = svc.client.xpending_range(keys.prompts, PROMPT_GROUP, "-", "+", 10, consumername="doomed-gen")
        leased_ids = {e["message_id"] for e in pend}
        leased = {schema.decode(f[b"data"], schema.PromptTask).group_id
                  for i, f in svc.client.xrange(keys.prompts) if i in leased_ids}
        assert len(leased) == 3
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        assert wait_for(lambda: svc.counters.get("reclaims", 0) >= 3, 15)
        again = svc.client.xreadgroup(PROMPT_GROUP, "live-gen", {keys.prompts: ">"}, count=10)[0][1]
        regids = [schema.decode(f[b"data"], schema.PromptTask).group_id for _, f in again]
        assert leased <= set(regids), "every prompt the dead generator held is handed out again, same id"
        assert len(regids) == len(set(regids))
        assert _metric_after(svc, "reclaims") >= 3
        # The re-run and a late delivery of the original both push the same group: it lands once.
        gid = sorted(leased)[0]
        push(svc.ingest_addr, [schema.encode(make_group(gid)), schema.encode(make_group(gid))])
        assert wait_for(lambda: svc.counters.get("dedupes", 0) == 1)
        assert stream_group_ids(svc.client, keys) == [gid]
    finally:
        svc.stop()
        t.join(10)


def _metric_after(svc, name):
    svc.publish_metrics()
    return float(svc.client.hget(svc.keys.metrics, f"buffer:{name}"))
