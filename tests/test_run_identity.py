"""Runs cannot mix: a role that finds a finished or foreign run's state under its run.name refuses
with one line (the ways out named), or continues / clears it when run.resume / run.reset say so;
a live run is joined. A group sampled ahead of the learner's version is never trained (no negative
lag), and every unreadable trajectory entry, another schema version included, is quarantined."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from asyncrl.config import dump_yaml
from asyncrl.protocol import identity, schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups
from tests.buffer_support import REPO, buffer_cfg, push, start_thread, wait_for
from tests.helpers import make_group


def _finished_run(client, keys: Keys, cfg, leftovers: int = 4) -> str:
    """What a finished run leaves: its identity marked finished, the stop key, undelivered groups."""
    ident = identity.claim(client, keys, cfg, "learner")
    ensure_groups(client, keys)
    for i in range(leftovers):
        client.xadd(keys.trajectories, {"data": schema.encode(make_group(f"old{i}@e0", version=29))})
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.stop, "1")
    identity.mark_finished(pipe, keys, 30)
    pipe.execute()
    return ident["id"]


def test_siblings_join_one_identity_and_a_finished_run_is_refused_resumed_or_reset(tmp_path, redis_server):
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=same")
    client, keys = connect(redis_server.url), Keys("same")
    first = identity.claim(client, keys, cfg, "buffer")
    assert first["state"] == "live" and identity.claim(client, keys, cfg, "learner")["id"] == first["id"]

    old = _finished_run(client, keys, cfg)
    assert old == first["id"]
    with pytest.raises(identity.RunConflict) as e:
        identity.claim(client, keys, cfg, "buffer")
    line = str(e.value)
    assert "\n" not in line and "finished" in line and "version 30" in line
    assert "run.name" in line and "run.resume=true" in line and "run.reset=true" in line
    assert client.exists(keys.stop) and client.xlen(keys.trajectories) == 4  # nothing touched

    resumed = identity.claim(client, keys, buffer_cfg(tmp_path, redis_server, "run.name=same", "run.resume=true"),
                             "buffer")
    assert resumed["id"] == old and resumed["state"] == "live" and not client.exists(keys.stop)
    assert client.xlen(keys.trajectories) == 4  # resuming keeps the run's state

    _finished_run(client, keys, cfg, leftovers=0)
    fresh = identity.claim(client, keys, buffer_cfg(tmp_path, redis_server, "run.name=same", "run.reset=true"),
                           "buffer")
    assert fresh["id"] != old and fresh["state"] == "live"
    assert not client.exists(keys.stop) and not client.exists(keys.trajectories)  # the old run's keys are gone


def test_legacy_stop_key_and_a_foreign_schema_version_are_refused(tmp_path, redis_server):
    client = connect(redis_server.url)
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=legacy")
    keys = Keys("legacy")
    client.set(keys.stop, "1")  # an earlier run that wrote no identity, and ended
    with pytest.raises(identity.RunConflict, match="no identity, ended"):
        identity.claim(client, keys, cfg, "buffer")

    keys = Keys("foreign")
    client.hset(keys.identity, mapping={"id": "f" * 32, "created_at": "1", "created_by": "learner",
                                        "schema_version": str(schema.SCHEMA_VERSION + 1), "state": "live"})
    resume = buffer_cfg(tmp_path, redis_server, "run.name=foreign", "run.resume=true")
    with pytest.raises(identity.RunConflict, match="another asyncrl.*run.reset=true"):
        identity.claim(client, keys, resume, "buffer")
    reset = buffer_cfg(tmp_path, redis_server, "run.name=foreign", "run.reset=true")
    assert identity.claim(client, keys, reset, "buffer")["schema_version"] == str(schema.SCHEMA_VERSION)

    keys = Keys("adopted")  # state with no identity and no stop key: written by hand; adopted
    client.xadd(keys.trajectories, {"data": b"x"})
    adopted = buffer_cfg(tmp_path, redis_server, "run.name=adopted")
    assert identity.claim(client, keys, adopted, "buffer")["state"] == "live"


@pytest.mark.parametrize("role", ["buffer", "learner"])
def test_a_role_started_on_a_finished_runs_redis_refuses_in_one_line(tmp_path, redis_server, tiny_model, role):
    """The README's roles-separately block run again on the same Redis: refused before anything starts
    (the buffer used to read the old stop key and leave; the learner trained the old groups)."""
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=again", f"model.path={tiny_model}")
    client, keys = connect(redis_server.url), Keys("again")
    _finished_run(client, keys, cfg)
    path = tmp_path / "again.yaml"
    path.write_text(dump_yaml(cfg))
    proc = subprocess.run([sys.executable, "-m", "asyncrl", role, str(path)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "run.resume=true" in lines[0] and "run.name" in lines[0], proc.stderr[-2000:]
    assert client.xlen(keys.trajectories) == 4 and client.exists(keys.stop)


def test_a_group_sampled_ahead_of_the_learner_is_dropped_never_trained(tmp_path, redis_server):
    from learners.reader import TrajectoryReader

    cfg = buffer_cfg(tmp_path, redis_server, "run.name=ahead", "learner.batch_groups=2")
    client, keys = connect(redis_server.url), Keys("ahead")
    ensure_groups(client, keys)
    for i in range(3):
        client.xadd(keys.trajectories, {"data": schema.encode(make_group(f"old{i}@e0", version=29))})
    client.xadd(keys.trajectories, {"data": schema.encode(make_group("new0@e0", version=0))})
    client.xadd(keys.trajectories, {"data": schema.encode(make_group("new1@e0", version=1))})
    reader = TrajectoryReader(client, keys, cfg)
    got, dropped = [], 0
    for _ in range(4):  # fifo reads what it needs, the learner reads again for what it dropped
        more, num = reader.read(2 - len(got), version=1)
        got, dropped = got + more, dropped + num
    assert [g.group_id for _, g in got] == ["new0@e0", "new1@e0"]
    assert dropped == 3 and reader.stats()["dropped_ahead"] == 3
    assert int(client.hget(keys.learner, "dropped_groups")) == 3  # given back to the admission budget
    assert client.xpending(keys.trajectories, LEARNER_GROUP)["pending"] == 2  # only the handed-out ones


UNKNOWN_VERSION = max(schema.SCHEMA_VERSION, schema.EPISODE_SCHEMA_VERSION) + 1  # no frame of this code carries it


def _other_schema(group: schema.TrajectoryGroup, version: int) -> bytes:
    raw = msgspec.msgpack.decode(schema.encode(group))
    raw["schema_version"] = version
    return msgspec.msgpack.encode(raw)


def test_every_unreadable_entry_is_quarantined_on_the_fresh_and_the_recovery_path_alike(tmp_path, redis_server):
    from learners.quarantine import Quarantine
    from learners.reader import TrajectoryReader

    cfg = buffer_cfg(tmp_path, redis_server, "run.name=unread", "learner.batch_groups=1")
    client, keys = connect(redis_server.url), Keys("unread")
    ensure_groups(client, keys)
    bad = [{"data": _other_schema(make_group("v3@e0"), UNKNOWN_VERSION)}, {"nodata": b"1"},
           {"data": b"\x93\x01\x02"}]
    for fields in bad:
        client.xadd(keys.trajectories, fields)
    client.xadd(keys.trajectories, {"data": schema.encode(make_group("good@e0"))})
    limits = schema.RunLimits.from_config(cfg, 128)
    # Recovery path: the same entries, delivered before a restart, never acked.
    rkeys = Keys("unread-recovery")
    ensure_groups(client, rkeys)
    for fields in bad:
        client.xadd(rkeys.trajectories, fields)
    gone = client.xadd(rkeys.trajectories, {"data": schema.encode(make_group("gone@e0"))})
    client.xreadgroup(LEARNER_GROUP, "learner-0", {rkeys.trajectories: ">"})
    client.xdel(rkeys.trajectories, gone)  # deleted after delivery: nothing to train or keep

    fresh = Quarantine(client, keys, limits)
    reader = TrajectoryReader(client, keys, cfg, quarantine=fresh)
    got = []
    for _ in range(5):  # one entry a read (learner.batch_groups=1): the learner reads again
        got += reader.read(1 - len(got), version=0)[0]
    assert [g.group_id for _, g in got] == ["good@e0"]
    recovery = Quarantine(client, rkeys, limits)
    entries = client.xreadgroup(LEARNER_GROUP, "learner-0", {rkeys.trajectories: "0"})[0][1]
    assert [recovery.entry(e, f) for e, f in entries] == [None] * 4

    for q, k in ((fresh, keys), (recovery, rkeys)):
        reasons = [f[b"reason"] for _, f in client.xrange(k.quarantine)]
        assert reasons == [b"schema_version", b"missing", b"schema"], reasons
        assert q.num == 3
    assert recovery.num_deleted == 1
    assert client.xpending(rkeys.trajectories, LEARNER_GROUP)["pending"] == 0


def test_the_buffer_reports_its_own_stall_with_what_it_waits_on(tmp_path, redis_server):
    """No launcher: the buffer's own check says, in its metrics hash and an event, that no group came."""
    cfg = buffer_cfg(tmp_path, redis_server, "run.name=bstall", "run.stall_timeout_s=1", "learner.batch_groups=2")
    svc, t = start_thread(cfg)
    try:
        assert wait_for(lambda: svc.client.xlen(svc.keys.prompts) > 0)
        push(svc.ingest_addr, [schema.encode(make_group("p0@e0"))])
        assert wait_for(lambda: svc.counters.get("groups", 0) == 1)
        assert wait_for(lambda: svc.client.hget(svc.keys.metrics, "buffer:stall"), timeout=6)
        line = svc.client.hget(svc.keys.metrics, "buffer:stall").decode()
        assert line.startswith("STALL buffer: no_trajectory") and "waiting for generators" in line, line
        kinds = [f[b"kind"] for _, f in svc.client.xrange(svc.keys.events)]
        assert b"stall" in kinds
        from asyncrl.observe.status import snapshot

        own = [s for s in snapshot(svc.client, svc.keys, cfg)["stalls"] if s["source"] == "self"]
        assert [s["role"] for s in own] == ["buffer"] and own[0]["since_s"] >= 1.0
        push(svc.ingest_addr, [schema.encode(make_group("p1@e0"))])  # it moves again: the report is cleared
        assert wait_for(lambda: svc.client.hget(svc.keys.metrics, "buffer:stall") == b"", timeout=6)
    finally:
        svc.stop()
        t.join(10)


@pytest.mark.slow
def test_a_learner_resuming_an_old_runs_redis_trains_no_leftover_reports_its_stall_and_quarantines(tmp_path,
                                                                                                   tiny_model):
    """A learner started by hand, no launcher, on the Redis of a finished run of the same name with
    run.resume=true: the old run's leftover groups (sampled at version 29) are dropped, not trained at
    a negative lag; a group of another schema version, fresh and pending from before the restart, is
    quarantined and the learner goes on; when its data stops it reports its own stall within
    run.stall_timeout_s; more data, and it finishes."""
    import time

    from asyncrl.config import load_config
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.observe.status import snapshot
    from tests.helpers import fixed_groups

    timeout_s = 4.0
    with LocalRedis(tmp_path / "redis") as redis:
        cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.name=old", "run.max_steps=2",
                                 f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                                 "learner.batch_groups=2", "algorithm.max_staleness=1000",
                                 "checkpoint.export_hf=false", f"run.stall_timeout_s={timeout_s}",
                                 "run.resume=true"])
        path = tmp_path / "old.yaml"
        path.write_text(dump_yaml(cfg))
        client, keys = connect(redis.url), Keys("old")
        _finished_run(client, keys, cfg, leftovers=3)
        v3 = _other_schema(make_group("v3@e0"), UNKNOWN_VERSION)
        client.xadd(keys.trajectories, {"data": v3})
        client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"})  # pending, as a crash leaves them
        client.xadd(keys.trajectories, {"data": v3})  # and one on the fresh path
        good = fixed_groups(4)
        for g in good[:2]:
            client.xadd(keys.trajectories, {"data": schema.encode(g)})
        log_path = tmp_path / "learner.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "learner", str(path)], stdout=log,
                                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            try:
                assert wait_for(lambda: int(client.hget(keys.learner, "step") or 0) == 1, timeout=300), \
                    log_path.read_text()[-3000:]
                stepped = time.time()
                assert wait_for(lambda: client.hget(keys.learner, "stall"), timeout=timeout_s + 10)
                reported_after = time.time() - stepped
                line = client.hget(keys.learner, "stall").decode()
                assert line.startswith("STALL learner: no_step") and "waiting for data" in line, line
                own = [s for s in snapshot(client, keys, cfg)["stalls"] if s["source"] == "self"]
                assert [s["role"] for s in own] == ["learner"]
                for g in good[2:]:
                    client.xadd(keys.trajectories, {"data": schema.encode(g)})
                assert proc.wait(timeout=300) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
        text = log_path.read_text()
        assert "STALL learner: no_step" in text and "moves again" in text
        assert reported_after < timeout_s + 3, reported_after
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["lag_max"] >= 0 and min(int(k) for k in r["lag_hist"]) >= 0 for r in rows)
        assert {g for r in rows for g in r["generators_in_batch"]} == {good[0].generator_id}
        assert rows[-1]["quarantined"] == 2 and rows[-1]["dropped_stale"] == 3
        reasons = [f[b"reason"] for _, f in client.xrange(keys.quarantine)]
        assert reasons == [b"schema_version", b"schema_version"], reasons
        assert "re-training 0, quarantined 1" in text, text[-3000:]
        assert client.xpending(keys.trajectories, LEARNER_GROUP)["pending"] == 0
        assert identity.read(client, keys)["state"] == "finished"
        assert "Traceback" not in text
