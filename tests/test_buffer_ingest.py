"""The buffer service over a real redis-server and real ZeroMQ sockets."""

import threading
import time

import zmq

from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import PROMPT_GROUP, Keys
from asyncrl.protocol.store import LEARNER_GROUP
from buffers.prompts import admission_budget, admission_version
from buffers.service import BufferService
from tests.helpers import make_group


def _start(cfg):
    svc = BufferService(cfg)
    t = threading.Thread(target=svc.run, daemon=True)
    t.start()
    deadline = time.time() + 10
    while not svc.client.get(svc.keys.ingest_addr) and time.time() < deadline:
        time.sleep(0.05)
    return svc, t


def _push(addr, frames):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.connect(addr)
    for f in frames:
        s.send(f)
    s.close()


def _wait(pred, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_garbage_frames_are_counted_and_the_service_keeps_going(make_cfg, redis_server):
    cfg = make_cfg("run.name=ingest", "buffer.check_released=false", redis=redis_server)  # synthetic ids
    svc, t = _start(cfg)
    try:
        good = make_group("p1@e0")
        bad_lengths = make_group("p2@e0")
        bad_lengths.samples[0].logprobs = schema.pack_f32([-0.1])  # 1 log-prob for 3 tokens
        frames = [
            b"\x00\xffgarbage\x13\x37" * 10,  # not msgpack
            schema.encode(bad_lengths),  # decodes, fails validation
            schema.encode(make_group("p3@e0"))[:-5],  # truncated
            schema.encode(good),
            schema.encode(good),  # a duplicate of the same group id
        ]
        _push(svc.ingest_addr, frames)
        assert _wait(lambda: svc.counters.get("frames", 0) == 5)
        assert t.is_alive(), "a bad frame must never stop the service"
        rejects = {k: v for k, v in svc.counters.items() if k.startswith("reject:")}
        assert sum(rejects.values()) == 3, rejects
        assert rejects.get("reject:length_mismatch") == 1
        assert svc.counters["groups"] == 1 and svc.counters["dedupes"] == 1
        entries = svc.client.xrange(svc.keys.trajectories)
        assert len(entries) == 1
        assert schema.decode(entries[0][1][b"data"], schema.TrajectoryGroup).group_id == "p1@e0"
        svc.publish_metrics()
        assert int(svc.client.hget(svc.keys.metrics, "buffer:reject:length_mismatch")) == 1
    finally:
        svc.stop()
        t.join(timeout=10)


def test_admission_control_bounds_released_prompts(make_cfg, redis_server):
    cfg = make_cfg("run.name=admit", "learner.batch_groups=4", "algorithm.max_staleness=1", redis=redis_server)
    svc, t = _start(cfg)
    keys = Keys("admit")
    try:
        # Learner at version 0, staleness 1: at most (0 + 1 + 1) * 4 = 8 groups released.
        assert _wait(lambda: svc.client.xlen(keys.prompts) == 8)
        time.sleep(0.5)
        assert svc.client.xlen(keys.prompts) == 8
        svc.client.set(keys.version, 2)
        assert _wait(lambda: svc.client.xlen(keys.prompts) == admission_budget(2, 1, 4, 0) == 16)
        # A dropped group is given back to the budget so the pipe never starves.
        svc.client.hset(keys.learner, "dropped_groups", 3)
        assert _wait(lambda: svc.client.xlen(keys.prompts) == 19)
        ids = [schema.decode(f[b"data"], schema.PromptTask).group_id for _, f in svc.client.xrange(keys.prompts)]
        assert len(set(ids)) == len(ids)
    finally:
        svc.stop()
        t.join(timeout=10)


def _heartbeat(client, keys, gid, version, state="generating", proof=""):
    client.hset(keys.gen(gid), mapping=schema.Heartbeat(id=gid, state=state, version=version,
                                                        schema_version=schema.SCHEMA_VERSION,
                                                        token_proof=proof).to_hash())
    client.expire(keys.gen(gid), 60)
    client.xadd(keys.notify, {"k": "fleet"})


def test_admission_counts_from_the_lowest_version_a_generator_holds(make_cfg, redis_server, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token-for-the-run")
    token.chmod(0o600)
    cfg = make_cfg("run.name=admitfleet", "learner.batch_groups=4", "algorithm.max_staleness=1",
                   f"deploy.run_token_file={token}", redis=redis_server)
    keys = Keys("admitfleet")
    svc, t = _start(cfg)
    try:
        client = svc.client
        assert _wait(lambda: client.xlen(keys.prompts) == 8)
        # The learner stepped to version 3, but the push of 3 has not landed: g0 still holds 2. The
        # next batch waits for it (counting from the learner would release 4 x 5 = 20 now).
        _heartbeat(client, keys, "g0", 2, proof=security.token_proof("s3cret-token-for-the-run", "g0"))
        client.set(keys.version, 3)
        client.xadd(keys.notify, {"k": "version"})
        assert _wait(lambda: client.xlen(keys.prompts) == admission_budget(2, 1, 4, 0) == 16)
        time.sleep(0.8)  # longer than the release fallback period
        assert client.xlen(keys.prompts) == 16
        # Left out of the minimum: a generator holding no version, a draining one, and one without
        # the run token (a forged heartbeat cannot hold the run back).
        _heartbeat(client, keys, "joining", -1)
        _heartbeat(client, keys, "leaving", 0, state="draining",
                   proof=security.token_proof("s3cret-token-for-the-run", "leaving"))
        _heartbeat(client, keys, "forged", 0, proof="00" * 32)
        time.sleep(0.8)
        assert client.xlen(keys.prompts) == 16
        # The weights land: g0 at 3, the next batch is released at once.
        _heartbeat(client, keys, "g0", 3, proof=security.token_proof("s3cret-token-for-the-run", "g0"))
        assert _wait(lambda: client.xlen(keys.prompts) == admission_budget(3, 1, 4, 0) == 20, timeout=2)
    finally:
        svc.stop()
        t.join(timeout=10)


def test_admission_version_rule():
    hb = schema.Heartbeat
    admit_all = lambda h: True  # noqa: E731
    assert admission_version(5, {}, admit_all) == 5
    assert admission_version(5, {"a": hb(id="a", version=4), "b": hb(id="b", version=5)}, admit_all) == 4
    assert admission_version(5, {"a": hb(id="a", version=-1)}, admit_all) == 5
    assert admission_version(5, {"a": hb(id="a", version=1, state="draining")}, admit_all) == 5
    assert admission_version(5, {"a": hb(id="a", version=1)}, lambda h: False) == 5
    assert admission_version(2, {"a": hb(id="a", version=7)}, admit_all) == 2


def test_expired_leases_are_reclaimed_and_late_duplicates_dropped(make_cfg, redis_server):
    cfg = make_cfg("run.name=reclaim", "learner.batch_groups=2", "buffer.lease_timeout_s=0.5", redis=redis_server)
    svc, t = _start(cfg)
    keys = Keys("reclaim")
    try:
        assert _wait(lambda: svc.client.xlen(keys.prompts) == 4)
        # A generator leases two prompts and dies without acking them.
        leased = svc.client.xreadgroup(PROMPT_GROUP, "dead-gen", {keys.prompts: ">"}, count=2)[0][1]
        gids = {schema.decode(f[b"data"], schema.PromptTask).group_id for _, f in leased}
        assert _wait(lambda: svc.counters.get("reclaims", 0) >= 2, timeout=15)
        again = svc.client.xreadgroup(PROMPT_GROUP, "live-gen", {keys.prompts: ">"}, count=10)[0][1]
        regids = [schema.decode(f[b"data"], schema.PromptTask).group_id for _, f in again]
        assert gids <= set(regids), "reclaimed prompts keep their group ids"
        # Both the late original and the re-run push the same group: it lands once.
        gid = sorted(gids)[0]
        _push(svc.ingest_addr, [schema.encode(make_group(gid)), schema.encode(make_group(gid))])
        assert _wait(lambda: svc.counters.get("dedupes", 0) == 1)
        assert svc.client.xlen(keys.trajectories) == 1
        assert svc.client.xinfo_groups(keys.trajectories)[0]["name"] in (LEARNER_GROUP, LEARNER_GROUP.encode())
    finally:
        svc.stop()
        t.join(timeout=10)
