"""Multi-node safety: Redis credentials from a file, ZeroMQ CURVE keys, the run token.

- Redis: `buffer.redis_url` may carry a user (`redis://alice@host:6379/0`), TLS (`rediss://...`,
  with `?ssl_ca_certs=/path/ca.pem`) and even a password, but a password on a URL ends up in
  `ps` and in config dumps; `deploy.redis_password_file` keeps it in a file instead. `connect()`
  (asyncrl/protocol/keys.py) passes it to redis-py for every role.
- ZeroMQ: with `deploy.curve_keys_dir` the buffer's PULL socket is a CURVE server (encrypted, and a
  ZAP handler admits only the client public keys in `{dir}/clients/`); generators are CURVE clients.
  Without CURVE but with a run token, the socket uses PLAIN with the token as password (shared
  secret, not encrypted: use CURVE across untrusted networks).
- Run token (`deploy.run_token_file`): generators present it to the buffer (PLAIN password, above)
  and in their heartbeat as an HMAC of their id (the token itself never lands in Redis); the
  learner ignores generators whose heartbeat lacks a valid one, so they never join a weight group.

Only the standard library is imported at module level; zmq where a socket is configured.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PLAIN_USER = "asyncrl"
ZAP_DOMAIN = "asyncrl"
_secrets: dict[str, str] = {}  # file path -> contents, read once per process


def read_secret(path: str) -> str:
    """A secret file's contents (stripped); a clear error if it is missing or readable by others."""
    if path not in _secrets:
        p = Path(path).expanduser()
        if not p.exists():
            from asyncrl.config import ConfigError

            raise ConfigError(f"secret file {p} does not exist (deploy.*_file settings name files holding secrets)")
        if p.stat().st_mode & 0o077:
            log.warning("secret file %s is readable by group/others: chmod 600 it", p)
        _secrets[path] = p.read_text().strip()
    return _secrets[path]


def write_secret(path: str | Path, value: str) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return p


# ---- Redis -----------------------------------------------------------------------------------------

_redis_password_file = ""


def set_redis_password_file(path: str) -> None:
    """Called once at start (cli._load) with `deploy.redis_password_file`; `connect()` then uses it."""
    global _redis_password_file
    _redis_password_file = path


def redis_password() -> str | None:
    return read_secret(_redis_password_file) if _redis_password_file else None


def redis_url_file(run_dir: Path) -> Path:
    """Where a deployment publishes the run's Redis address (no password in it) for the other jobs."""
    return Path(run_dir) / "redis_url"


def resolve_redis_url(cfg) -> str:
    """`buffer.redis_url`, else the address the run's first job published in the run directory."""
    if cfg.buffer.redis_url:
        return cfg.buffer.redis_url
    f = redis_url_file(cfg.run_dir)
    if f.exists():
        return f.read_text().strip()
    raise ValueError(f"no Redis address: set buffer.redis_url or start the run first ({f} does not exist)")


# ---- run token ---------------------------------------------------------------------------------------


def run_token(cfg) -> str | None:
    return read_secret(cfg.deploy.run_token_file) if cfg.deploy.run_token_file else None


def token_proof(token: str, generator_id: str) -> str:
    """What a generator's heartbeat carries: proves it holds the token without revealing it."""
    return hmac.new(token.encode(), generator_id.encode(), hashlib.sha256).hexdigest()


def proof_ok(token: str | None, generator_id: str, proof: bytes | str | None) -> bool:
    if token is None:
        return True
    if isinstance(proof, bytes):
        proof = proof.decode()
    return bool(proof) and hmac.compare_digest(proof, token_proof(token, generator_id))


# ---- ZeroMQ CURVE ------------------------------------------------------------------------------------


def generate_keys(out: str | Path, num_clients: int = 1) -> list[Path]:
    """Writes `server.key`(+`_secret`) and client pairs; the buffer admits the public keys in `clients/`."""
    import zmq

    out = Path(out)
    (out / "clients").mkdir(parents=True, exist_ok=True)
    written = []

    def write_pair(name: str, public_dir: Path) -> None:
        public, secret = zmq.curve_keypair()
        pub = public_dir / f"{name}.key"
        pub.write_text(f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
        sec = out / f"{name}.key_secret"
        write_secret(sec, f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
                          f'    secret-key = "{secret.decode()}"')
        written.extend([pub, sec])

    write_pair("server", out)
    for i in range(num_clients):
        write_pair(f"client{i}" if num_clients > 1 else "client", out / "clients")
    return written


def _load_pair(path: Path) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path.exists():
        raise ValueError(f"CURVE key file {path} is missing: run `asyncrl keys generate --out DIR` and set "
                         "deploy.curve_keys_dir=DIR")
    return zmq.auth.load_certificate(str(path))


def _client_secret_file(keys_dir: Path) -> Path:
    explicit = os.environ.get("ASYNCRL_CURVE_CLIENT_KEY")  # one key pair per generator host, if wanted
    if explicit:
        return Path(explicit)
    return keys_dir / "client.key_secret"


class LoggingAuthenticator:
    """A zmq.auth ThreadAuthenticator whose refusals are logged (zmq logs them at DEBUG only), or
    handed to `on_refuse(status_text)` (called from the authenticator's thread) when given."""

    def __new__(cls, ctx, on_refuse=None):
        from zmq.auth.thread import ThreadAuthenticator

        class _Auth(ThreadAuthenticator):
            def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):
                if status_code != b"200":
                    if on_refuse is not None:  # the caller counts and logs it
                        on_refuse(status_text.decode(errors="replace"))
                    else:
                        log.warning("refused a ZeroMQ connection: %s (wrong run token or unknown CURVE key)",
                                    status_text.decode(errors="replace"))
                super()._send_zap_reply(request_id, status_code, status_text, user_id)

        return _Auth(ctx, log=logging.getLogger("zmq.auth"))


def secure_server_socket(cfg, ctx, sock, on_refuse=None):
    """Makes `sock` (the buffer's PULL) a CURVE or PLAIN server; returns the authenticator (or None)."""
    import zmq

    keys_dir, token = cfg.deploy.curve_keys_dir, run_token(cfg)
    if not keys_dir and token is None:
        return None
    auth = LoggingAuthenticator(ctx, on_refuse)
    auth.start()
    if keys_dir:
        public, secret = _load_pair(Path(keys_dir) / "server.key_secret")
        auth.configure_curve(domain=ZAP_DOMAIN, location=str(Path(keys_dir) / "clients"))
        sock.curve_secretkey, sock.curve_publickey = secret, public
        sock.curve_server = True
        log.info("ingest socket: CURVE server, clients admitted from %s/clients", keys_dir)
    else:
        auth.configure_plain(domain=ZAP_DOMAIN, passwords={PLAIN_USER: token})
        sock.plain_server = True
        log.info("ingest socket: run token required (PLAIN)")
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    return auth


def secure_client_socket(cfg, sock) -> bool:
    """Makes a generator's PUSH socket present its CURVE key or the run token; False: no credentials set."""
    keys_dir, token = cfg.deploy.curve_keys_dir, run_token(cfg)
    if keys_dir:
        server_public, _ = _load_pair(Path(keys_dir) / "server.key")
        public, secret = _load_pair(_client_secret_file(Path(keys_dir)))
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
    elif token is not None:
        sock.plain_username, sock.plain_password = PLAIN_USER.encode(), token.encode()
    return bool(keys_dir) or token is not None


class AuthFailed(ConnectionRefusedError):
    """The buffer refused this generator's credentials (run token or CURVE key)."""


def auth_monitor(sock):
    """A monitor socket reporting refused handshakes on `sock`; the caller closes it (before ctx.term())."""
    import zmq

    return sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


async def watch_auth(mon, what: str) -> None:
    """Raises AuthFailed once the peer refuses our handshake: better to fail loudly than push into a void."""
    from zmq.utils.monitor import parse_monitor_message

    event = parse_monitor_message(await mon.recv_multipart())
    log.error("%s: the buffer refused our credentials (event %s, endpoint %s): wrong run token "
              "(deploy.run_token_file) or CURVE key (deploy.curve_keys_dir)", what, event["event"], event["endpoint"])
    raise AuthFailed(f"{what}: refused by the buffer at {event['endpoint']!r}")


def advertised_host(bind_host: str, advertise: str = "") -> str:
    """The address other nodes use: `advertise` (deploy.advertise_host) when set, else the bind
    address, or this node's name when bound to all interfaces."""
    import socket

    if advertise:
        return advertise
    return socket.gethostname() if bind_host in ("0.0.0.0", "::") else bind_host
