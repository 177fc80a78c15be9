"""Separate hosts on one machine: Linux network namespaces on a private subnet (10.231.0.0/24,
used only inside them), each with its own loopback, interface, address and port space, joined by a
bridge in a switch namespace of their own. Processes run in a host with `Hosts.argv(name, argv)`
(`ip netns exec`); `close()` kills every process left in them and deletes the namespaces (the veth
pairs go with them). Needs root (`ip netns add`); `unavailable()` says why not otherwise."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import time

PREFIX = "asyncrl-"
SUBNET = "10.231.0"
CLONE_NEWNET = 0x40000000


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add`)"
    probe = f"{PREFIX}probe-{os.getpid()}"
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Deletes `asyncrl-PID-*` namespaces whose creating process is gone (a crashed earlier run)."""
    removed = []
    for ns in _namespaces():
        parts = ns.split("-")
        if ns.startswith(PREFIX) and len(parts) >= 3 and parts[1].isdigit():
            try:
                os.kill(int(parts[1]), 0)
                continue  # its test run is still alive
            except ProcessLookupError:
                pass
            _kill_all(ns)
            _ip("netns", "del", ns, check=False)
            removed.append(ns)
    return removed


def _kill_all(ns: str) -> None:
    for _ in range(20):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


class Hosts:
    """Hosts `names[0]`, `names[1]`, ... at 10.231.0.1, .2, ... (interface eth0 in each)."""

    def __init__(self, names: tuple[str, ...] = ("a", "b", "c")):
        self.tag = f"{PREFIX}{os.getpid()}"
        self.names = names
        self.switch = f"{self.tag}-sw"
        self.made: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def addr(self, name: str) -> str:
        return f"{SUBNET}.{self.names.index(name) + 1}"

    def argv(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(name), *argv]

    def start(self) -> Hosts:
        try:
            self._add(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for name in self.names:
                ns = self._add(self.ns(name))
                _ip("-n", self.switch, "link", "add", f"p-{name}", "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", self.switch, "link", "set", f"p-{name}", "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(name)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add(self, ns: str) -> str:
        _ip("netns", "add", ns)
        self.made.append(ns)
        return ns

    def inside(self, name: str):
        return inside(self.ns(name))

    def listeners(self, name: str) -> list[tuple[str, str, int]]:
        """(process, address, port) of every TCP listener in host `name`, from `ss -ltnp`."""
        out = subprocess.run(self.argv(name, ["ss", "-Hltnp"]), capture_output=True, text=True,
                             timeout=30, check=True).stdout
        rows = []
        for line in out.splitlines():
            fields = line.split()
            local = fields[3]
            host, port = local.rsplit(":", 1)
            proc = fields[5] if len(fields) > 5 else ""
            rows.append((proc, host.strip("[]").split("%")[0], int(port)))
        return rows

    def close(self) -> None:
        for ns in reversed(self.made):
            _kill_all(ns)
            _ip("netns", "del", ns, check=False)
        self.made = []


@contextlib.contextmanager
def inside(ns: str):
    """This thread in namespace `ns` (sockets made meanwhile stay there; threads started meanwhile
    are born there), and back in its own afterwards."""
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        yield
    finally:
        os.close(target)
        assert libc.setns(home, CLONE_NEWNET) == 0, "could not return to this thread's own namespace"
        os.close(home)
