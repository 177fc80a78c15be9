"""Per-role CPU affinity: `generator.cpus`, `learner.cpus`, `buffer.cpus`.

A value is a Linux CPU list ("0", "0-3,8"); empty means no pinning (the OS schedules the role
anywhere, as before). A pinned role's whole process tree runs on its CPUs: the launcher sets the
affinity in the child before it execs (`preexec`), every process the role starts inherits it
(torchrun's ranks, vLLM's engine core and workers), and each role's entry point applies it to itself
too (`apply_to_self`), so a role started on its own (Slurm, a benchmark) is pinned the same way.
The local redis-server follows `buffer.cpus`.

Thread counts follow the CPUs, because an affinity mask alone does not stop a library from starting
more threads than it has cores (they would time-slice one core):
- generator: `OMP_NUM_THREADS` is the role's CPUs per worker, and `generator.cpu_threads` is
  ignored. One worker runs inside vLLM's engine core (its uni executor), inside the inherited mask.
  With tensor parallelism vLLM's multiprocessing executor binds each worker's OpenMP threads itself
  (`VLLM_CPU_OMP_THREADS_BIND`: "auto" picks cores from the mask but reserves one of them for the
  scheduler process, "nobind" leaves them unbound, a CPU list binds exactly those); we pass the
  role's CPUs as the list, split into `tensor_parallel_size` equal parts, one thread per CPU
  (`OMP_PLACES` / `OMP_PROC_BIND`);
- learner: `OMP_NUM_THREADS` = its CPUs / `learner.nproc`, which torch reads as its thread count
  and torchrun passes to every rank;
- buffer: no threaded math; only the mask.

`run.affinity=auto` (the default): when no role's `cpus` is set and this process may use at most
`AUTO_MAX_CPUS` CPUs, `asyncrl run` assigns the roles disjoint CPUs itself (`auto_assignment`) and
writes them into the run's config.yaml, so every child (and a generator added by `asyncrl scale`)
pins itself as if the user had set them. On a bigger machine, or with `run.affinity=off`, nothing is
pinned unless a role's `cpus` says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from asyncrl.config import Config, ConfigError, parse_cpus

log = logging.getLogger(__name__)

ROLES = ("generator", "learner", "buffer")


def format_cpus(cpus) -> str:
    """(0, 1, 2, 3, 8) -> '0-3,8' (the form taskset, /proc and vLLM use)."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cpus_of(cfg: Config, role: str) -> tuple[int, ...]:
    assert role in ROLES, role
    return parse_cpus(getattr(cfg, role).cpus)


AUTO_MAX_CPUS = 4  # run.affinity=auto pins the roles apart on machines of at most this many CPUs


def auto_split(allowed) -> dict[str, tuple[int, ...]] | None:
    """The roles' CPUs for `run.affinity=auto` on a machine whose usable CPUs are `allowed` (None: pin nothing).

    Unpinned on a small machine, vLLM's OpenMP threads and the learner's torch threads time-slice the
    same cores and both run several times slower. So each gets a core of its own:
    - 2 CPUs: generator 0, learner 1; the buffer (and the local redis-server) share the generator's
      CPU (they mostly wait on sockets);
    - 3 CPUs: generator 0, learner 1, buffer 2: the buffer and Redis, on the path of every batch the
      learner reads and every version it publishes, no longer wait behind a busy core;
    - 4 CPUs: generator 0-1, learner 2, buffer 3: the second spare core goes to vLLM, whose forward
      passes (n samples a prompt, token by token) are what RL post-training mostly waits for; the
      learner's step on one core is already short next to it;
    - 1 CPU: nothing to separate; more than AUTO_MAX_CPUS: the OS scheduler has room, nothing pinned.
    (CPU numbers are positions in `allowed`, not necessarily 0..n-1.)"""
    cpus = tuple(sorted(allowed))
    n = len(cpus)
    if n < 2 or n > AUTO_MAX_CPUS:
        return None
    if n == 2:
        return {"generator": cpus[:1], "learner": cpus[1:], "buffer": cpus[:1]}
    if n == 3:
        return {"generator": cpus[:1], "learner": cpus[1:2], "buffer": cpus[2:]}
    return {"generator": cpus[:2], "learner": cpus[2:3], "buffer": cpus[3:]}


def auto_assignment(cfg: Config, allowed=None) -> tuple[dict[str, tuple[int, ...]] | None, str]:
    """What `asyncrl run` pins (None: leave `{role}.cpus` as they are) and the one line it prints.

    Explicit `{role}.cpus` win: if any is set, nothing is chosen for the others. `allowed` defaults to
    this process's CPUs (`os.sched_getaffinity(0)`)."""
    allowed = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
    explicit = {role: cpus_of(cfg, role) for role in ROLES}
    if any(explicit.values()):
        return None, "affinity: " + ", ".join(
            f"{role} {format_cpus(c) if c else 'any'}" for role, c in explicit.items()) + " (from generator/learner/buffer.cpus)"
    if cfg.run.affinity == "off":
        return None, "affinity: none (run.affinity=off)"
    split = auto_split(allowed)
    if split is None:
        why = "1 CPU" if len(allowed) < 2 else f"{len(allowed)} CPUs > {AUTO_MAX_CPUS}"
        return None, f"affinity: none (auto: {why}, the OS schedules the roles)"
    tp, nproc = cfg.generator.tensor_parallel_size, cfg.learner.nproc
    if len(split["generator"]) % tp or len(split["learner"]) < nproc:
        return None, (f"affinity: none (auto on {len(allowed)} CPUs: {len(split['generator'])} generator CPU(s) "
                      f"for tensor_parallel_size={tp}, {len(split['learner'])} learner CPU(s) for "
                      f"learner.nproc={nproc} do not fit; set {{role}}.cpus to pin)")
    return split, "affinity: " + ", ".join(f"{role} {format_cpus(split[role])}" for role in ROLES) + (
        f" (auto on {len(allowed)} CPUs; run.affinity=off to disable)")


def check_available(cfg: Config, roles=ROLES) -> None:
    """Raises ConfigError (naming the key) if a role asks for a CPU this process may not use."""
    allowed = os.sched_getaffinity(0)
    for role in roles:
        missing = [c for c in cpus_of(cfg, role) if c not in allowed]
        if missing:
            raise ConfigError(f"{role}.cpus={getattr(cfg, role).cpus!r}: CPU {format_cpus(missing)} is not "
                              f"available to this process (allowed: {format_cpus(allowed)}); pick CPUs from "
                              "that list or leave it empty for no pinning")


def role_env(cfg: Config, role: str) -> dict[str, str]:
    """Environment a pinned role needs so its thread pools match its CPUs ({} when not pinned)."""
    cpus = cpus_of(cfg, role)
    if not cpus:
        return {}
    if role == "generator":
        tp = cfg.generator.tensor_parallel_size
        share = len(cpus) // tp
        parts = [format_cpus(cpus[i * share:(i + 1) * share]) for i in range(tp)]
        return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(parts), "OMP_NUM_THREADS": str(share)}
    if role == "learner":
        return {"OMP_NUM_THREADS": str(max(1, len(cpus) // cfg.learner.nproc))}
    return {}


def preexec(cpus: tuple[int, ...]) -> Callable[[], None] | None:
    """A Popen `preexec_fn` that pins the child before it execs (None when `cpus` is empty).
    Only a syscall runs between fork and exec, which is safe even if the parent has threads."""
    if not cpus:
        return None
    mask = set(cpus)
    return lambda: os.sched_setaffinity(0, mask)


def apply_to_self(cfg: Config, role: str) -> None:
    """A role's entry point, after `check_available`: pins this process and sets its thread
    environment. Call it before torch or vLLM is imported (they size their thread pools once, at import)."""
    cpus = cpus_of(cfg, role)
    if not cpus:
        return
    if os.sched_getaffinity(0) != set(cpus):
        os.sched_setaffinity(0, set(cpus))
    env = role_env(cfg, role)
    os.environ.update(env)
    if role == "generator" and cfg.generator.cpu_threads != int(env["OMP_NUM_THREADS"]):
        log.info("generator.cpus=%s: the engine runs %s OpenMP thread(s) per worker, one per CPU; "
                 "generator.cpu_threads=%d is ignored", cfg.generator.cpus, env["OMP_NUM_THREADS"],
                 cfg.generator.cpu_threads)
    log.info("affinity role=%s cpus=%s%s", role, format_cpus(cpus), "".join(f" {k}={v}" for k, v in env.items()))
