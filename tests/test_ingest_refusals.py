"""Refused handshakes at the buffer's CURVE ingest socket, on real sockets and a real `asyncrl buffer`
process: peers with no credentials, the wrong server key or an unknown client key are each counted
(`buffer:auth_refused` and by reason), logged once per reason per interval, and shown by `asyncrl status`."""

from __future__ import annotations

import zmq
import zmq.auth

from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import Keys, connect
from tests.buffer_support import BufferProcess, buffer_cfg, wait_for
from tests.helpers import make_group

REASONS = ("reject:auth_no_credentials", "reject:auth_handshake", "reject:auth_wrong_server_key",
           "reject:auth_unknown_credentials")


def _peer(ctx, addr, configure):
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RECONNECT_IVL, 50)  # a peer that keeps trying: many refusals, few log lines
    configure(sock)
    sock.connect(addr)
    sock.send(schema.encode(make_group("refused@e0")), zmq.NOBLOCK)
    return sock


def test_refused_handshakes_are_counted_per_reason_and_logged_once_per_reason(tmp_path, redis_server):
    keys_dir, other = tmp_path / "keys", tmp_path / "other"
    security.generate_keys(keys_dir)
    security.generate_keys(other)  # a server and a client pair the buffer has never seen
    cfg = buffer_cfg(tmp_path, redis_server, f"deploy.curve_keys_dir={keys_dir}", "logging.prometheus=false")
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    buffer = BufferProcess(cfg, tmp_path).start(client, keys)
    addr = client.get(keys.ingest_addr).decode()
    server_public, _ = zmq.auth.load_certificate(str(keys_dir / "server.key"))
    wrong_server, _ = zmq.auth.load_certificate(str(other / "server.key"))
    known = zmq.auth.load_certificate(str(keys_dir / "client.key_secret"))
    unknown = zmq.auth.load_certificate(str(other / "client.key_secret"))

    def curve(pair, server):
        def configure(sock):
            sock.curve_publickey, sock.curve_secretkey = pair
            sock.curve_serverkey = server
        return configure

    ctx = zmq.Context()
    peers = [_peer(ctx, addr, lambda s: None),  # no credentials at all
             _peer(ctx, addr, curve(known, wrong_server)),  # a known client key, the wrong server key
             _peer(ctx, addr, curve(unknown, server_public))]  # an unknown client key
    try:
        def counts():
            m = {k.decode(): v for k, v in client.hgetall(keys.metrics).items()}
            c = {k: int(float(m.get(f"buffer:{k}", 0))) for k in ("auth_refused", *REASONS)}
            # No credentials: the mechanism mismatch, or the peer hanging up on it first.
            c["no_credentials"] = c["reject:auth_no_credentials"] + c["reject:auth_handshake"]
            return c

        def all_counted():
            c = counts()
            return min(c["no_credentials"], c["reject:auth_wrong_server_key"],
                       c["reject:auth_unknown_credentials"]) >= 1 and c["auth_refused"] >= 10

        assert wait_for(all_counted, 20, 0.2), (counts(), buffer.log_path.read_text()[-3000:])
        c = counts()
        assert c["auth_refused"] == sum(c[r] for r in REASONS), \
            (c, buffer.log_path.read_text()[-3000:])
        assert not client.exists(keys.seen("refused@e0")), "nothing of a refused peer is stored"

        log = buffer.log_path.read_text()
        for reason in REASONS:
            assert log.count(f"total {reason[7:]}=") <= 1, (reason, log[-3000:])
        assert c["reject:auth_wrong_server_key"] > 1, "a retrying peer is counted on every refused attempt"
        assert log.count("total auth_wrong_server_key=") == 1, "... and logged once in the interval"

        from asyncrl.observe.status import snapshot

        snap = snapshot(client, keys, cfg)
        assert snap["buffer"]["auth_refused"] >= c["auth_refused"]
        assert snap["buffer"]["rejected"]["auth_wrong_server_key"] >= 1
    finally:
        for p in peers:
            p.close(0)
        ctx.term()
        buffer.stop()
