"""TCPStore masters that listen on the address they are given, not on every interface.

torch's TCPStore master ignores its host argument and binds `*` (both the libuv and the classic
backend), so the weight group's store and torchrun's rendezvous store were reachable from any
interface, without authentication, although the address they publish is 127.0.0.1. torch accepts a
listening socket made by the caller (`master_listen_fd`, checked in the installed torch 2.13), so
we bind it ourselves and hand it over. The weight group's store is `master_store`; torchrun's stores
are bound through `python -m asyncrl.launch.listen`.
"""

from __future__ import annotations

import socket


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to `host:port` (0: a free port) and listening.

    IPv4 first (the peers connect over IPv4 unless the host has only IPv6). A host name that is not
    itself loopback but resolves to a loopback address (Debian's `127.0.1.1 <hostname>` line) is
    refused: other nodes could never reach the socket."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    family, kind, proto, _, addr = infos[0]
    if _is_loopback(addr[0]) and not _is_loopback(host) and host != "localhost":
        raise ValueError(f"{host!r} resolves to the loopback address {addr[0]} on this node, so other nodes "
                         "cannot reach a socket bound to it: give the node's routable address instead")
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.listen(128)
    return sock


# TCPStore's parameters after (host_name, port, world_size, is_master), in order (torch 2.13).
_LATER_ARGS = ("timeout", "wait_for_workers", "multi_tenant", "master_listen_fd", "use_libuv")


def bound_tcpstore_class():
    """A `torch.distributed.TCPStore` whose master listens on `host_name` only (a subclass, so
    isinstance checks in torch still hold); clients are unchanged."""
    import torch.distributed as dist

    base = getattr(dist.TCPStore, "_asyncrl_base", dist.TCPStore)

    class BoundTCPStore(base):
        _asyncrl_base = base

        def __init__(self, host_name, port, world_size=None, is_master=False, *args, **kwargs):
            kwargs.update(zip(_LATER_ARGS, args, strict=False))  # torchrun passes the timeout by position
            if is_master and kwargs.get("master_listen_fd") is None:
                sock = listening_socket(host_name, port)
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns (and closes) it from here
            super().__init__(host_name, port, world_size, is_master, **kwargs)

    return BoundTCPStore


def master_store(host: str, port: int, **kwargs):
    """A TCPStore master listening on `host:port` only (0: a free port; read it back from `.port`)."""
    return bound_tcpstore_class()(host, port, None, True, **kwargs)
