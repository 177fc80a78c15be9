"""Generator heartbeats (asyncrl/protocol/schema.py `Heartbeat`) and the learner's view of the fleet
(asyncrl/protocol/fleet.py): one pipelined read, admission, weight verification."""

from __future__ import annotations

import logging

from asyncrl.config import load_config
from asyncrl.protocol import fleet, schema, security
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.schema import Heartbeat


def _events(client, keys: Keys) -> list[tuple[str, str]]:
    return [(f[b"kind"].decode(), f.get(b"id", b"").decode()) for _, f in client.xrange(keys.events)]


def test_a_full_heartbeat_round_trips_through_a_redis_hash(redis_server):
    client, keys = connect(redis_server.url), Keys("hb-roundtrip")
    hb = Heartbeat(id="g0", state="generating", version=7, epoch=3, workers=2, tokens=1234, baseline_tokens=56,
                   groups=9, tokens_per_s=12.5, idle_ratio=0.25, idle_s=1.125, reward_errors=1, sync_s_total=0.75,
                   last_pause_s=0.0625, num_syncs=4, sampling_temperature=0.7, sampling_top_p=0.95, sampling_top_k=-1,
                   checksums=[11, -22, 33], pid=4242, host="node-a", updated_at=1_700_000_000.123456,
                   schema_version=schema.SCHEMA_VERSION, token_proof="ab" * 32)
    client.hset(keys.gen("g0"), mapping=hb.to_hash())
    assert client.hget(keys.gen("g0"), "checksums") == b"11,-22,33"  # what redis-cli shows
    assert fleet.read_fleet(client, keys) == {"g0": hb}


def test_an_old_heartbeat_without_a_schema_version_is_version_1(redis_server):
    client, keys = connect(redis_server.url), Keys("hb-old")
    client.hset(keys.gen("old"), mapping={"id": "old", "state": "generating", "version": 2, "checksums": "5,6"})
    (hb,) = fleet.read_fleet(client, keys).values()
    assert (hb.schema_version, hb.version, hb.checksums, hb.workers, hb.token_proof) == (1, 2, [5, 6], 1, "")


def test_a_malformed_heartbeat_is_skipped_with_one_warning(redis_server, caplog):
    client, keys = connect(redis_server.url), Keys("hb-malformed")
    client.hset(keys.gen("good"), mapping={"id": "good", "version": 1})
    client.hset(keys.gen("v"), mapping={"id": "v", "version": "abc"})
    client.hset(keys.gen("c"), mapping={"id": "c", "version": 1, "checksums": "1,x"})
    client.hset(keys.gen("anon"), mapping={"state": "generating"})  # no id
    with caplog.at_level(logging.WARNING, logger="asyncrl.protocol.fleet"):
        for _ in range(3):
            assert list(fleet.read_fleet(client, keys)) == ["good"]
    warned = sorted(r.getMessage().split()[1] for r in caplog.records)
    assert warned == [keys.gen(g) for g in ("anon", "c", "v")], "one warning per malformed heartbeat"


def test_read_fleet_reads_every_heartbeat_in_one_pipeline(redis_server, monkeypatch):
    client, keys = connect(redis_server.url), Keys("hb-pipeline")
    for i in range(20):
        client.hset(keys.gen(f"g{i}"), mapping=Heartbeat(id=f"g{i}", version=i).to_hash())
    commands, pipelines = [], []
    execute_command, pipeline = client.execute_command, client.pipeline

    def counting_execute(*args, **kwargs):
        commands.append(args[0])
        return execute_command(*args, **kwargs)

    def counting_pipeline(*args, **kwargs):
        pipe = pipeline(*args, **kwargs)
        pipelines.append(pipe)
        return pipe

    monkeypatch.setattr(client, "execute_command", counting_execute)  # one round trip each
    monkeypatch.setattr(client, "pipeline", counting_pipeline)
    got = fleet.read_fleet(client, keys)
    assert sorted(got) == sorted(f"g{i}" for i in range(20)) and got["g7"].version == 7
    assert commands == ["SCAN"], "only the SCAN goes alone; every HGETALL rides the pipeline"
    assert len(pipelines) == 1


def test_admission_refuses_a_bad_token_proof_and_another_schema_version_once(redis_server, tmp_path):
    token_file = security.write_secret(tmp_path / "token", "s3cret")
    cfg = load_config(None, ["run.name=hb-admission", f"deploy.run_token_file={token_file}"])
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    proof = security.token_proof("s3cret", "good")
    good = Heartbeat(id="good", workers=2, schema_version=schema.SCHEMA_VERSION, token_proof=proof)
    forged = Heartbeat(id="forged", schema_version=schema.SCHEMA_VERSION, token_proof=security.token_proof("x", "forged"))
    newer = Heartbeat(id="newer", schema_version=schema.SCHEMA_VERSION + 1,
                      token_proof=security.token_proof("s3cret", "newer"))
    draining = Heartbeat(id="leaving", state="draining", schema_version=schema.SCHEMA_VERSION,
                         token_proof=security.token_proof("s3cret", "leaving"))
    assert fleet.admitted(cfg, good) == (True, "", "")
    assert fleet.admitted(cfg, forged)[::2] == (False, "auth_refused")
    assert fleet.admitted(cfg, newer)[::2] == (False, "schema_refused")
    snapshot = {hb.id: hb for hb in (good, forged, newer, draining)}
    admission = fleet.Admission(cfg, client, keys)
    for _ in range(3):
        assert fleet.live_members(snapshot, admission) == ["good.0", "good.1"]
    assert sorted(_events(client, keys)) == [("auth_refused", "forged"), ("schema_refused", "newer")]


def test_weight_check_counts_a_matching_and_a_mismatching_report_once():
    check = fleet.WeightCheck()
    check.sent(3, [1, 2])
    snapshot = {"ok": Heartbeat(id="ok", version=3, checksums=[1, 2]),
                "bad": Heartbeat(id="bad", version=3, checksums=[1, 9]),
                "other": Heartbeat(id="other", version=2, checksums=[5])}  # a version not sent: not checked
    assert check.check(snapshot, version=3) == [("bad", 3, [1, 9], [1, 2])]
    assert (check.num_verified, check.num_mismatch) == (1, 1)
    assert check.check(snapshot, version=3) == [], "each (generator, version) is checked once"
    check.check({}, version=3 + fleet.KEEP_VERSIONS + 1)
    assert check.synced == {}, "what was sent for old versions is forgotten"


def test_the_learner_logs_a_weight_mismatch_event(redis_server):
    from learners.fleet import Fleet

    client, keys = connect(redis_server.url), Keys("hb-learner")
    learner = Fleet(load_config(None, ["run.name=hb-learner"]), client, keys)  # the learner's view of the fleet
    learner.weight_check.sent(3, [1, 2])
    client.hset(keys.gen("ok"), mapping=Heartbeat(id="ok", version=3, checksums=[1, 2]).to_hash())
    client.hset(keys.gen("bad"), mapping=Heartbeat(id="bad", version=3, checksums=[7]).to_hash())
    for _ in range(2):
        learner.verify_fleet_weights(learner.read_fleet(), 3)
    assert _events(client, keys) == [("weights_mismatch", "bad")]
    assert (learner.weight_check.num_verified, learner.weight_check.num_mismatch) == (1, 1)
