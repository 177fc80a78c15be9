"""A sandbox for untrusted Python (the model's programs): one fresh process per run.

What bounds a run (`SandboxLimits`, the `env.sandbox_*` keys):
- a separate process in a session of its own, started with `python -I -S` (no site packages, no
  PYTHON* variables, the standard library only), its program in a file of a throw-away working
  directory that is deleted afterwards;
- CPU time (RLIMIT_CPU), address space (RLIMIT_AS), file size (RLIMIT_FSIZE), open files, no core
  files; a wall-clock timeout after which its whole process group is killed;
- output: stdout is read up to `output_bytes`; past that the process is killed and the output
  marked as cut; of stderr the last `output_bytes` are kept (where a traceback says what failed);
- no network: a new network namespace with no interface but a down loopback (made directly by root,
  through an unprivileged user namespace otherwise); where the kernel refuses one, an audit hook,
  which Python code cannot remove, refuses every socket;
- no other process: RLIMIT_NPROC 0 (no fork, no thread), and the audit hook refuses subprocesses,
  exec, fork, signals, ctypes and the native modules these go through (`_posixsubprocess`,
  `_ctypes`, `_socket`, `mmap`, ...), and changing directory;
- no other user's files: run as root, the process drops to `nobody` (no capability left) before the
  program starts, so the kernel's own permissions apply; a handful of standard-library modules
  (math, fractions, decimal, statistics, itertools, collections, re, json, random, datetime, ...)
  are imported before the drop, for an interpreter installed where `nobody` cannot read;
- nothing of the host's secrets: the environment is scrubbed to PATH, LANG and HOME (the working
  directory); the audit hook lets the program read only its working directory and the Python
  installation, and write, rename, link, truncate or change the mode of files only in its working
  directory.

The audit hook is a second line, not the boundary: the uid drop, the resource limits and the
namespaces are the kernel's. A program run by a user other than root keeps that user's file
permissions (behind the audit hook): run untrusted programs as root, which drops to `nobody`, or as
a user of their own.

`run_python` is a coroutine: the process runs beside the event loop, never blocking it.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
FILE_BYTES = 1 << 20  # the largest file a program may write in its working directory

# Runs first in the sandboxed interpreter, then the program. The audit hook cannot be removed.
BOOT = """
import os, sys
# Modules a program may import once the process has dropped to `nobody` (an interpreter installed
# where `nobody` cannot read imports nothing more after the drop).
import math, cmath, fractions, decimal, statistics, itertools, functools, operator, collections, heapq, bisect
import re, json, string, random, datetime, textwrap, copy, numbers, enum, dataclasses, typing
if os.getuid() == 0:  # root (no user namespace): drop to nobody before any of the program runs
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    if os.getuid() == 0 or os.geteuid() == 0:
        raise SystemExit("the sandbox could not drop root")
_DENY = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
         "os.kill", "os.killpg", "ctypes.", "pty.", "os.startfile", "shutil.rmtree", "webbrowser.", "os.chdir",
         "os.fchdir", "os.chroot", "os.setuid", "os.setgid", "sys.remote_exec", "os.putenv", "os.unsetenv")
_NO_IMPORT = {"_posixsubprocess", "_ctypes", "ctypes", "_socket", "socket", "mmap", "_multiprocessing",
              "multiprocessing", "subprocess", "pty", "resource", "_signal", "signal", "fcntl", "termios"}
_HOME = os.getcwd()
_OWN = (_HOME + os.sep,)
_READ = tuple({os.path.realpath(p) + os.sep for p in (sys.base_prefix, sys.prefix, _HOME)}) + ("/dev/null", "/dev/urandom")
def _inside(path, roots):
    if isinstance(path, int):
        return True
    path = os.path.realpath(os.path.join(_HOME, os.fsdecode(path)))
    return (path + os.sep).startswith(roots) or path in roots
def _audit(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"{event} is not allowed in the sandbox")
    if event == "import" and args and args[0] in _NO_IMPORT:
        raise PermissionError(f"importing {args[0]} is not allowed in the sandbox")
    if event == "open" and args[0] is not None:
        writing = (isinstance(args[1], str) and any(c in args[1] for c in "wax+")) or (args[2] & 3)
        if not _inside(args[0], _OWN if writing else _READ):
            raise PermissionError(f"the sandbox may not open {args[0]!r}")
    if event in ("os.listdir", "os.scandir") and args and args[0] is not None and not _inside(args[0], _READ):
        raise PermissionError(f"the sandbox may not list {args[0]!r}")
    if event in ("os.remove", "os.mkdir", "os.rmdir", "os.truncate", "os.chmod", "os.chown", "os.chflags",
                 "os.utime", "os.setxattr", "os.removexattr") and args and args[0] is not None:
        if not _inside(args[0], _OWN):
            raise PermissionError(f"the sandbox may not use {args[0]!r}")
    if event in ("os.rename", "os.link", "os.symlink") and not all(_inside(a, _OWN) for a in args[:2]):
        raise PermissionError(f"the sandbox may not {event[3:]} {args[0]!r} to {args[1]!r}")
sys.addaudithook(_audit)
del _audit
with open("main.py") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_s: int = 2
    memory_mb: int = 512
    output_bytes: int = 4096
    timeout_s: float = 5.0

    @classmethod
    def from_config(cls, env_cfg) -> SandboxLimits:
        return cls(cpu_s=env_cfg.sandbox_cpu_s, memory_mb=env_cfg.sandbox_memory_mb,
                   output_bytes=env_cfg.sandbox_output_bytes, timeout_s=env_cfg.sandbox_timeout_s)


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None: killed (timeout or output limit); negative: the signal that ended it
    timed_out: bool = False
    output_cut: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_cut


def _limit_child(limits: SandboxLimits) -> None:
    """Runs in the child between fork and exec: resource limits, then the user and network namespace."""
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    memory = limits.memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_BYTES, FILE_BYTES))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # No new process or thread once the program runs (enforced for every uid but root's, and root
    # drops to `nobody` in BOOT before the program starts).
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
    # No network: a fresh network namespace. Root makes one directly and keeps its uid (BOOT drops it
    # to `nobody` after the interpreter has started, whose files `nobody` may not be able to read); any
    # other user needs a user namespace for it. Refused by the kernel, the audit hook still refuses
    # every socket.
    flags = CLONE_NEWNET if os.getuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    ctypes.CDLL(None, use_errno=True).unshare(flags)


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Up to `cap` bytes of `stream`; (data, True) once more than that arrived."""
    data = b""
    while chunk := await stream.read(4096):
        data += chunk
        if len(data) > cap:
            return data[:cap], True
    return data, False


async def _read_tail(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """The last `cap` bytes of `stream` (a traceback's last line is what says what went wrong)."""
    data = b""
    while chunk := await stream.read(4096):
        data = (data + chunk)[-cap:]
    return data, False


async def run_python(code: str, limits: SandboxLimits) -> SandboxResult:
    """Runs `code` in a fresh sandboxed process (see the module doc) and returns what it printed."""
    workdir = tempfile.mkdtemp(prefix="asyncrl-sandbox-")
    t0 = time.monotonic()
    try:
        with open(os.path.join(workdir, "main.py"), "w") as f:
            f.write(code)
        if os.getuid() == 0:  # the program runs as `nobody` (BOOT): its folder is its own
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(os.path.join(workdir, "main.py"), NOBODY, NOBODY)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONDONTWRITEBYTECODE": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", "-c", BOOT, cwd=workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _limit_child(limits))
        reads = [asyncio.create_task(_read_capped(proc.stdout, limits.output_bytes)),
                 asyncio.create_task(_read_tail(proc.stderr, limits.output_bytes))]
        timed_out = False
        try:
            done, _ = await asyncio.wait(reads, timeout=limits.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            # Either stream over its cap ends the run at once; else wait for both within the timeout.
            if not any(t.result()[1] for t in done):
                left = limits.timeout_s - (time.monotonic() - t0)
                _, pending = await asyncio.wait(reads, timeout=max(left, 0.0))
                timed_out = bool(pending)
        finally:
            _kill_group(proc.pid)
            exit_code = await proc.wait()
            for t in reads:
                t.cancel()
        outs = [t.result() if t.done() and not t.cancelled() else (b"", False) for t in reads]
        cut = any(c for _, c in outs)
        return SandboxResult(stdout=outs[0][0].decode(errors="replace"), stderr=outs[1][0].decode(errors="replace"),
                             exit_code=None if (timed_out or cut) else exit_code, timed_out=timed_out,
                             output_cut=cut, seconds=time.monotonic() - t0)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(pid: int) -> None:
    """SIGKILLs the run's process group (its session leader's group), whatever is left of it."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
