"""Multi-node safety on real sockets: CURVE keys and the run token at the buffer's ingest socket
(a real `asyncrl buffer` process), the generator outbox noticing its refusal, Redis passwords."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import redis as redispy
import zmq
import zmq.asyncio
import zmq.auth

from asyncrl.launch.redis_server import LocalRedis
from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import Keys, connect
from tests.helpers import Procs, make_group


def _start_buffer(tmp_path, make_cfg, redis_server, *overrides):
    cfg = make_cfg("run.name=auth", "buffer.check_released=false", *overrides, redis=redis_server)  # synthetic ids
    procs = Procs(tmp_path)
    procs.spawn("buffer", [sys.executable, "-m", "asyncrl", "buffer", "configs/tiny.yaml",
                           f"run.dir={cfg.run.dir}", f"model.path={cfg.model.path}", "run.name=auth",
                           f"buffer.redis_url={redis_server.url}", "buffer.check_released=false", *overrides])
    client = connect(redis_server.url)
    keys = Keys("auth")
    deadline = time.monotonic() + 60
    while not client.get(keys.ingest_addr):
        assert time.monotonic() < deadline, procs.log("buffer")
        assert procs.procs["buffer"].poll() is None, procs.log("buffer")
        time.sleep(0.2)
    return cfg, procs, client, keys, client.get(keys.ingest_addr).decode()


def _push(addr, configure, group_id):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    configure(sock)
    sock.connect(addr)
    sock.send(schema.encode(make_group(group_id)))
    time.sleep(1.5)
    sock.close(0)
    ctx.term()


def _wait_seen(client, keys, group_id, timeout_s=10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.exists(keys.seen(group_id)):
            return True
        time.sleep(0.2)
    return False


def _curve(keys_dir, client_secret):
    def configure(sock):
        server_public, _ = zmq.auth.load_certificate(str(keys_dir / "server.key"))
        public, secret = zmq.auth.load_certificate(str(client_secret))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
    return configure


def test_curve_admits_known_key_and_refuses_unknown(tmp_path, make_cfg, redis_server):
    keys_dir, other = tmp_path / "keys", tmp_path / "other"
    security.generate_keys(keys_dir)
    security.generate_keys(other)  # a key pair the buffer has never seen
    cfg, procs, client, keys, addr = _start_buffer(tmp_path, make_cfg, redis_server, f"deploy.curve_keys_dir={keys_dir}")
    try:
        _push(addr, _curve(keys_dir, other / "client.key_secret"), "bad@e0")
        _push(addr, lambda s: None, "plain@e0")  # no CURVE at all
        _push(addr, _curve(keys_dir, keys_dir / "client.key_secret"), "good@e0")
        assert _wait_seen(client, keys, "good@e0"), procs.log("buffer")
        assert not client.exists(keys.seen("bad@e0")) and not client.exists(keys.seen("plain@e0"))
        time.sleep(1.5)  # metrics are published every second
        assert int(client.hget(keys.metrics, "buffer:auth_refused") or 0) >= 1
        assert "refused a ZeroMQ connection" in procs.log("buffer")
    finally:
        procs.close()


def test_run_token_refused_and_generator_outbox_notices(tmp_path, make_cfg, redis_server):
    token_file = security.write_secret(tmp_path / "token", "right-token")
    wrong_file = security.write_secret(tmp_path / "wrong", "wrong-token")
    cfg, procs, client, keys, addr = _start_buffer(tmp_path, make_cfg, redis_server,
                                                   f"deploy.run_token_file={token_file}")
    try:
        def plain(token):
            return lambda s: (setattr(s, "plain_username", b"asyncrl"), setattr(s, "plain_password", token))
        _push(addr, plain(b"wrong-token"), "bad@e0")
        _push(addr, plain(b"right-token"), "good@e0")
        assert _wait_seen(client, keys, "good@e0"), procs.log("buffer")
        assert not client.exists(keys.seen("bad@e0"))
        assert "refused a ZeroMQ connection" in procs.log("buffer")

        # The generator's real outbox with the wrong token: the refusal reaches its on_refused hook.
        from generators.outbox import GroupOutbox

        wrong_cfg = make_cfg("run.name=auth", f"deploy.run_token_file={wrong_file}", redis=redis_server)

        async def outbox_refused():
            from asyncrl.protocol.keys import aconnect

            aredis = await aconnect(redis_server.url)
            refused = asyncio.get_running_loop().create_future()
            ctx = zmq.asyncio.Context()
            box = GroupOutbox(aredis, keys, "gbad", 60, ctx=ctx,
                              secure=lambda s: security.secure_client_socket(wrong_cfg, s),
                              on_refused=lambda e: refused.done() or refused.set_result(e))
            await box.connect()
            box.put("outbox@e0", b"0-1", schema.encode(make_group("outbox@e0")))
            try:
                return await asyncio.wait_for(refused, 20)
            finally:
                box.close()
                ctx.term()
                await aredis.aclose()

        error = asyncio.run(outbox_refused())
        assert isinstance(error, security.AuthFailed)
        assert not client.exists(keys.seen("outbox@e0"))
    finally:
        procs.close()


def test_learner_side_token_proof():
    proof = security.token_proof("t0k", "g1")
    assert security.proof_ok("t0k", "g1", proof.encode())
    assert not security.proof_ok("t0k", "g2", proof)  # bound to the generator id
    assert not security.proof_ok("other", "g1", proof)
    assert not security.proof_ok("t0k", "g1", None)
    assert security.proof_ok(None, "g1", None)  # no token configured: everyone is in


def test_redis_password_required_and_read_from_file(tmp_path):
    server = LocalRedis(tmp_path / "redis", password="s3cret-pw").start()
    try:
        with pytest.raises(redispy.AuthenticationError):
            redispy.Redis(host="127.0.0.1", port=server.port).ping()
        with pytest.raises(redispy.AuthenticationError):
            redispy.Redis(host="127.0.0.1", port=server.port, password="wrong").ping()
        pw_file = security.write_secret(tmp_path / "redis.pw", "s3cret-pw")
        security.set_redis_password_file(str(pw_file))
        try:
            assert connect(server.address_url).ping()  # the URL carries no password
        finally:
            security.set_redis_password_file("")
        # A role process that is not given the file is refused at start, with the URL in the message.
        res = subprocess.run([sys.executable, "-c", "from asyncrl.protocol.keys import connect; import sys; "
                              f"connect({server.address_url!r})"], capture_output=True, text=True, timeout=60)
        assert res.returncode != 0 and "Authentication" in res.stderr + res.stdout
    finally:
        server.stop()


def test_keys_cli_writes_private_files(tmp_path):
    res = subprocess.run([sys.executable, "-m", "asyncrl", "keys", "generate", "--out", str(tmp_path / "k")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    secret = tmp_path / "k" / "server.key_secret"
    assert secret.stat().st_mode & 0o077 == 0
    public, private = zmq.auth.load_certificate(str(secret))
    assert len(public) == 40 and len(private) == 40
    assert (tmp_path / "k" / "clients" / "client.key").exists()


def test_learner_leaves_generators_without_the_token_or_of_another_schema_out_of_weight_groups(
        tmp_path, make_cfg, redis_server):
    """The learner's fleet (real Redis heartbeat hashes, the learner's own method): a generator of
    schema version 1 (no such field; an older install) or without the run token is never made a
    member, so an epoch is not re-formed around it again and again; each is named once in an event."""
    from learners.fleet import Fleet

    token_file = security.write_secret(tmp_path / "token", "s3cret")
    cfg = make_cfg("run.name=fleet", f"deploy.run_token_file={token_file}", redis=redis_server)
    client, keys = connect(redis_server.url), Keys("fleet")
    token = security.run_token(cfg)
    heartbeats = {
        "good": {"schema_version": schema.SCHEMA_VERSION, "token_proof": security.token_proof(token, "good")},
        "old": {"token_proof": security.token_proof(token, "old")},  # version 1 reported none
        "newer": {"schema_version": schema.SCHEMA_VERSION + 1, "token_proof": security.token_proof(token, "newer")},
        "tokenless": {"schema_version": schema.SCHEMA_VERSION},
        "forged": {"schema_version": schema.SCHEMA_VERSION, "token_proof": security.token_proof("guess", "forged")},
    }
    for gid, fields in heartbeats.items():
        client.hset(keys.gen(gid), mapping={"id": gid, "state": "generating", "workers": 2, **fields})
    learner = Fleet(cfg, client, keys)  # the learner's view of the fleet
    for _ in range(3):
        assert learner.live_members() == ["good.0", "good.1"]
    events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in client.xrange(keys.events)]
    refused = sorted((e["kind"], e["id"]) for e in events if e["kind"].endswith("_refused"))
    assert refused == [("auth_refused", "forged"), ("auth_refused", "tokenless"),
                       ("schema_refused", "newer"), ("schema_refused", "old")]
