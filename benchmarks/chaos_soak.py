"""Chaos soak: the tiny pipeline on CPU under a seeded schedule of faults, then an audit of what it did.

Every role is started by hand, each in its own session (as in the README's "Running the roles
separately"): a redis-server with AOF, `asyncrl buffer`, `asyncrl generator --id gN` (two at first),
`asyncrl learner`. Once the learner's first step is in, the soak runs `--minutes` and injects, at times
drawn from `--seed` (the same seed gives the same schedule):
- kill_learner / kill_generator / kill_buffer: SIGKILL of the role's whole session, restarted after a
  few seconds (the learner resumes its newest complete checkpoint; a generator comes back under the
  same id, its old leases reclaimed after buffer.lease_timeout_s);
- restart_redis: SIGKILL or SIGTERM (clean shutdown) of redis-server, started again on the same port
  and folder (the AOF replays) after a few seconds;
- scale_up / scale_down: a generator with a new id started; the newest extra one sent SIGTERM (it
  drains and leaves with exit 0), as the local backend of `asyncrl scale` does;
- slow_reward: for a window, the reward (benchmarks/chaos_reward.py) sleeps on a fraction of calls;
- stall_generator: SIGSTOP of a generator's session for some seconds, then SIGCONT;
- poison: malformed and wrong-schema frames pushed to the buffer's ZeroMQ ingest, and undecodable
  entries written straight into the trajectories stream.
A role that exits on its own is a crash: it is logged and restarted. At the end the learner is
restarted with run.max_steps two steps past its newest checkpoint, so the run ends at max_steps with
its last step checkpointed and acked; the buffer and the generators leave on the stop key.
Then the audit (benchmarks/chaos_audit.py), memory slopes, stalls after each fault and leftover
processes; a table on stdout and a JSON file.

    flock /tmp/asyncrl-bench.lock .venv/bin/python benchmarks/chaos_soak.py --minutes 30 --seed 1 \
        --json benchmarks/results/chaos_soak_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("kill_learner", "kill_generator", "kill_buffer", "restart_redis", "scale_up", "scale_down",
         "slow_reward", "stall_generator", "poison")
QUIET_S = 60.0  # soak seconds before the first fault and after the last (a sixth of a shorter soak)
SAMPLE_S = 5.0  # RSS / Redis memory sampling period
SLOPE_SKIP_S = 180.0  # a process's first seconds left out of its memory slope (start-up, caches filling)
MAX_GENERATORS = 3
MIN_GENERATORS = 1
CONFIG = [
    "run.name=soak", "run.max_steps=1000000", "run.stall_timeout_s=120", "learner.batch_groups=8",
    "checkpoint.every=3", "checkpoint.keep=2", "buffer.lease_timeout_s=20", "generator.drain_timeout_s=30",
    "reward.function=benchmarks.chaos_reward:slow_copy", "generator.cpus=0", "learner.cpus=1", "buffer.cpus=0",
    "buffer.retain_trained_s=0",  # the audit reads every stored group back from the trajectories stream
]


@dataclass
class Fault:
    at_s: float  # soak seconds
    kind: str
    target: str = ""  # a generator id where one is needed
    seconds: float = 0.0  # restart delay, stall or slow-reward window
    detail: str = ""  # restart_redis: kill or term


def make_schedule(seed: int, soak_s: float, mean_gap_s: float, only: tuple[str, ...] = KINDS) -> list[Fault]:
    """The faults of a soak, from the seed alone (and `only`, the kinds drawn from). Every kind comes
    once before any repeats."""
    rng = random.Random(seed)
    quiet_s = min(QUIET_S, soak_s / 6)
    times, t = [], quiet_s
    while t < soak_s - quiet_s:
        times.append(round(t, 1))
        t += rng.uniform(0.6, 1.4) * mean_gap_s
    kinds: list[str] = []
    while len(kinds) < len(times):
        batch = list(only)
        rng.shuffle(batch)
        kinds += batch
    fleet, next_id, faults = ["g0", "g1"], 2, []
    for at, kind in zip(times, kinds, strict=False):
        if kind == "scale_up" and len(fleet) >= MAX_GENERATORS:
            kind = "scale_down"
        elif kind == "scale_down" and len(fleet) <= MIN_GENERATORS:
            kind = "scale_up"
        if kind == "scale_up":
            faults.append(Fault(at, kind, f"g{next_id}"))
            fleet.append(f"g{next_id}")
            next_id += 1
        elif kind == "scale_down":
            faults.append(Fault(at, kind, fleet.pop()))
        elif kind in ("kill_generator", "stall_generator"):
            secs = rng.uniform(2, 5) if kind == "kill_generator" else rng.uniform(5, 25)
            faults.append(Fault(at, kind, rng.choice(fleet), round(secs, 1)))
        elif kind == "restart_redis":
            faults.append(Fault(at, kind, "redis", round(rng.uniform(2, 8), 1), rng.choice(["kill", "term"])))
        elif kind == "slow_reward":
            faults.append(Fault(at, kind, "", round(rng.uniform(20, 45), 1), "0.3 2.0"))
        elif kind == "poison":
            faults.append(Fault(at, kind))
        else:
            faults.append(Fault(at, kind, kind.split("_")[1], round(rng.uniform(2, 5), 1)))
    return faults


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Roles:
    """The soak's processes by role name, each in its own session, one log per role (appended across restarts)."""

    def __init__(self, work: Path, cfg_path: Path, port: int, env: dict):
        self.work, self.cfg_path, self.port, self.env = work, cfg_path, port, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.expected_exit: set[str] = set()  # killed or told to leave by the soak
        self.history: list[dict] = []  # every start and end
        self.sessions: set[int] = set()
        self.asyncrl = str(Path(sys.executable).with_name("asyncrl"))

    def argv(self, name: str, extra: list[str]) -> list[str]:
        if name == "redis":
            return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--appendonly", "yes",
                    "--appendfsync", "everysec", "--save", "", "--dir", str(self.work / "redis")]
        role = "generator" if name.startswith("g") else name
        ids = ["--id", name] if role == "generator" else []
        return [self.asyncrl, role, str(self.cfg_path), *ids, *extra]

    def start(self, name: str, extra: list[str] | None = None) -> None:
        log = open(self.work / "logs" / f"{name}.log", "a")
        log.write(f"\n===== chaos soak: start {name} at {time.time():.3f} =====\n")
        log.flush()
        p = subprocess.Popen(self.argv(name, extra or []), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                             env=self.env, start_new_session=True)
        log.close()
        self.procs[name] = p
        self.sessions.add(p.pid)
        self.expected_exit.discard(name)
        self.history.append({"role": name, "pid": p.pid, "started": time.time()})

    def signal(self, name: str, sig: int, expect_exit: bool = True) -> bool:
        from asyncrl.launch.launcher import kill_tree

        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return False
        if expect_exit:
            self.expected_exit.add(name)
        kill_tree(p.pid, sig)
        return True

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def reap(self) -> list[tuple[str, int, bool]]:
        """(role, exit code, expected) of every process that ended since the last call."""
        ended = []
        for name, p in list(self.procs.items()):
            if p.poll() is not None:
                expected = name in self.expected_exit
                self.history.append({"role": name, "pid": p.pid, "ended": time.time(), "rc": p.returncode,
                                     "expected": expected})
                ended.append((name, p.returncode, expected))
                del self.procs[name]
        return ended


def tree_rss(pid: int, seen: dict[int, float]) -> int:
    """RSS bytes of `pid` and all its descendants (torchrun starts its ranks in sessions of their
    own, so a session alone misses them); every process met is remembered in `seen` (pid -> start
    time) for the leftover check."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
            seen[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return total


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes), in bytes per minute."""
    if len(points) < 10:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


class Soak:
    def __init__(self, args):
        from asyncrl.config import dump_yaml, load_config
        from asyncrl.protocol.keys import Keys

        self.args = args
        self.work = Path(args.dir).resolve()
        shutil.rmtree(self.work, ignore_errors=True)
        for sub in ("logs", "redis", "runs"):
            (self.work / sub).mkdir(parents=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.model = self.work / "tiny"
        cfg = load_config(None, [f"run.dir={self.work / 'runs'}", f"model.path={self.model}",
                                 f"buffer.redis_url={self.url}", *CONFIG, *args.overrides])
        self.cfg = cfg
        self.cfg_path = self.work / "soak.yaml"
        self.cfg_path.write_text(dump_yaml(cfg))
        self.keys = Keys(cfg.run.name)
        self.slow_flag = self.work / "slow_reward"
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "CHAOS_SOAK_SLOW_REWARD": str(self.slow_flag)}
        self.roles = Roles(self.work, self.cfg_path, self.port, env)
        self.schedule = make_schedule(args.seed, args.minutes * 60, args.mean_gap, tuple(args.kinds.split(",")))
        self.injected: list[dict] = []
        self.pending: list[tuple[float, str, str]] = []  # (monotonic due, action, role)
        self.crashes: list[dict] = []
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.events_last = "0-0"
        self.poison = {"frames_sent": {}, "frames_confirmed": 0, "written": []}
        self.client = None
        self.fleet = ["g0", "g1"]
        self.seen: dict[int, float] = {}  # every process of a role's tree met while sampling: pid -> start time

    # ---- Redis, tolerant of its restarts -----------------------------------------------------------

    def redis(self):
        import redis

        if self.client is None:
            self.client = redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)
        return self.client

    def try_redis(self, fn, default=None):
        import redis

        try:
            return fn(self.redis())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return default

    def tail_events(self) -> None:
        """Copies new `events` entries (a stream capped at ~10,000 entries) so none is lost to the cap."""
        def read(c):
            return c.xread({self.keys.events: self.events_last}, count=5000) or []

        for _, entries in self.try_redis(read, []):
            for entry_id, fields in entries:
                self.events_last = entry_id.decode()
                self.events.append({"stream_id": self.events_last, **{k.decode(): v.decode(errors="replace")
                                                               for k, v in fields.items()}})

    # ---- start-up ---------------------------------------------------------------------------------

    def start_all(self) -> None:
        subprocess.run([self.roles.asyncrl, "tiny-model", "--out", str(self.model), "--warm-start-steps", "30"],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        self.roles.start("redis")
        deadline = time.time() + 30
        while self.try_redis(lambda c: c.ping()) is None:
            if time.time() > deadline:
                raise SystemExit("redis-server did not come up")
            time.sleep(0.2)
        self.roles.start("learner")
        self.roles.start("buffer")
        for g in self.fleet:
            self.roles.start(g)

    def rows(self) -> list[dict]:
        path = self.cfg.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return out

    def wait_first_step(self, timeout_s: float) -> float:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.watch_roles()
            if self.rows():
                return time.time()
            time.sleep(1)
        raise SystemExit(f"no learner step within {timeout_s:.0f}s; logs in {self.work / 'logs'}")

    # ---- faults -----------------------------------------------------------------------------------

    def inject(self, f: Fault, now: float) -> None:
        record = {**asdict(f), "t": time.time(), "done": True}
        r = self.roles
        if f.kind.startswith("kill_"):
            name = f.target if f.kind == "kill_generator" else {"kill_learner": "learner", "kill_buffer": "buffer"}[f.kind]
            record["done"] = r.signal(name, signal.SIGKILL)
            self.pending.append((now + f.seconds, "start", name))
        elif f.kind == "restart_redis":
            if f.detail == "term":
                record["done"] = r.signal("redis", signal.SIGTERM)
            else:
                record["done"] = r.signal("redis", signal.SIGKILL)
            self.client = None
            self.pending.append((now + f.seconds, "start", "redis"))
        elif f.kind == "scale_up":
            self.fleet.append(f.target)
            r.start(f.target)
        elif f.kind == "scale_down":
            if f.target in self.fleet:
                self.fleet.remove(f.target)
            # A pending restart of it is off; a stalled one is woken to take the SIGTERM.
            self.pending = [p for p in self.pending if not (p[2] == f.target and p[1] == "start")]
            record["done"] = r.signal(f.target, signal.SIGTERM)
            r.signal(f.target, signal.SIGCONT, expect_exit=True)
        elif f.kind == "stall_generator":
            record["done"] = r.signal(f.target, signal.SIGSTOP, expect_exit=False)
            self.pending.append((now + f.seconds, "cont", f.target))
        elif f.kind == "slow_reward":
            self.slow_flag.write_text(f.detail)
            self.pending.append((now + f.seconds, "fast", ""))
        elif f.kind == "poison":
            record.update(self.inject_poison())
        self.injected.append(record)
        print(f"[{f.at_s:7.1f}s] {f.kind} {f.target} {f.seconds or ''} {f.detail} done={record['done']}",
              flush=True)

    def run_pending(self, now: float) -> None:
        due = [p for p in self.pending if p[0] <= now]
        self.pending = [p for p in self.pending if p[0] > now]
        for _, action, name in due:
            if action == "start" and not self.roles.alive(name):
                if name.startswith("g") and name not in self.fleet:
                    continue
                extra = ["run.resume=true"] if name == "learner" else []
                self.roles.start(name, extra)
            elif action == "cont":
                self.roles.signal(name, signal.SIGCONT, expect_exit=False)
            elif action == "fast":
                self.slow_flag.unlink(missing_ok=True)

    def inject_poison(self) -> dict:
        """Bad frames to the ingest socket, bad entries straight into the trajectories stream."""
        import msgspec
        import zmq

        from asyncrl.protocol import schema

        frames = {
            "not_msgpack": b"\xc1\xc1 not a frame",
            "wrong_schema": msgspec.msgpack.encode({"type": "trajectory_group", "schema_version": 2, "x": 1}),
            "prompt_not_group": schema.encode(schema.PromptTask(schema_version=schema.SCHEMA_VERSION,
                                                                group_id="p0@e0", prompt_id="p0", prompt="a",
                                                                answer="a", released_at=time.time())),
            "unknown_prompt": schema.encode(_group("chaos-poison@e0")),
            "token_id": schema.encode(_group("chaos-poison@e0", token=10**6)),
        }
        out = {"frames": 0, "confirmed": False, "written": 0}
        before = self.try_redis(lambda c: _reject_total(c, self.keys))
        addr = self.try_redis(lambda c: c.get(self.keys.ingest_addr))
        if addr is not None and before is not None and self.roles.alive("buffer"):
            ctx = zmq.Context()
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(addr.decode())
            try:
                for name, frame in frames.items():
                    sock.send(frame)
                    self.poison["frames_sent"][name] = self.poison["frames_sent"].get(name, 0) + 1
                    out["frames"] += 1
            except zmq.Again:
                pass
            sock.close()
            ctx.term()
            deadline = time.time() + 15
            while time.time() < deadline:  # the buffer publishes its counters once a second
                after = self.try_redis(lambda c: _reject_total(c, self.keys))
                if after is not None and after - before >= out["frames"]:
                    out["confirmed"] = True
                    self.poison["frames_confirmed"] += out["frames"]
                    break
                time.sleep(0.5)
        bad_entries = {"undecodable": {"data": b"\x93\x01\x02"},
                       "wrong_schema_version": {"data": msgspec.msgpack.encode(
                           {"type": "trajectory_group", "schema_version": 99})},
                       "no_data_field": {"junk": b"1"}}
        for reason, fields in bad_entries.items():
            entry = self.try_redis(lambda c, f=fields: c.xadd(self.keys.trajectories, f))
            if entry is not None:
                self.poison["written"].append({"entry": entry.decode(), "what": reason})
                out["written"] += 1
        return out

    # ---- the loop ---------------------------------------------------------------------------------

    def watch_roles(self) -> None:
        for name, rc, expected in self.roles.reap():
            if expected:
                continue
            if name.startswith("g") and name not in self.fleet:
                continue
            if self.finishing and name != "redis":
                continue
            self.crashes.append({"role": name, "rc": rc, "t": time.time()})
            print(f"CRASH {name} exit {rc}: restarting in 5s", flush=True)
            self.pending.append((time.monotonic() + 5, "start", name))

    def sample(self, soak_t: float, phase: str = "soak") -> None:
        row = {"t": soak_t, "phase": phase, "rss": {}}
        for name, p in list(self.roles.procs.items()):
            if p.poll() is None:
                row["rss"][name] = {"pid": p.pid, "bytes": tree_rss(p.pid, self.seen)}
        row["redis_used_memory"] = self.try_redis(lambda c: int(c.info("memory")["used_memory"]))
        row["trajectories"] = self.try_redis(lambda c: int(c.xlen(self.keys.trajectories)))
        self.samples.append(row)

    finishing = False

    def run(self) -> dict:
        t_launch = time.time()
        self.start_all()
        t0_wall = self.wait_first_step(900)
        startup_s = t0_wall - t_launch
        t0 = time.monotonic()
        soak_s = self.args.minutes * 60
        todo = list(self.schedule)
        last_sample = last_events = -1e9
        print(f"first step {startup_s:.0f}s after launch; soak of {soak_s:.0f}s with {len(todo)} faults", flush=True)
        while (now := time.monotonic()) - t0 < soak_s:
            while todo and todo[0].at_s <= now - t0:
                self.inject(todo.pop(0), now)
            self.run_pending(now)
            self.watch_roles()
            if now - last_sample >= SAMPLE_S:
                self.sample(now - t0)
                last_sample = now
            if now - last_events >= 2:
                self.tail_events()
                last_events = now
            time.sleep(0.2)
        t_end = time.time()
        end = self.finish(t0)
        return {"startup_s": startup_s, "soak_started_at": t0_wall, "soak_ended_at": t_end, **end}

    def finish(self, t0: float) -> dict:
        """Everything back up, then the learner restarted to end at max_steps with its last step
        checkpointed; the others leave on the stop key."""
        if self.pending:
            self.run_pending(max(p[0] for p in self.pending))  # restarts, SIGCONTs, the slow window's end: now
        self.slow_flag.unlink(missing_ok=True)
        for g in self.fleet:
            self.roles.signal(g, signal.SIGCONT, expect_exit=False)
        for name in ["redis", "buffer", *self.fleet]:
            if not self.roles.alive(name):
                self.roles.start(name)
        from learners.checkpoint import latest

        deadline = time.monotonic() + 300
        while latest(self.cfg.checkpoint_dir) is None and time.monotonic() < deadline:
            time.sleep(1)
        self.finishing = True
        self.roles.signal("learner", signal.SIGKILL)
        time.sleep(1)
        self.roles.reap()
        ckpt = latest(self.cfg.checkpoint_dir)
        ckpt_step = int(json.loads((ckpt / "meta.json").read_text())["step"]) if ckpt else 0
        final_steps = ckpt_step + 2
        self.roles.start("learner", ["run.resume=true", f"run.max_steps={final_steps}"])
        t_stop = time.monotonic()
        learner_rc = None
        while time.monotonic() - t_stop < 900:
            self.tail_events()
            if not self.roles.alive("learner"):
                learner_rc = self.roles.procs["learner"].returncode
                break
            if not self.roles.alive("redis"):
                self.roles.start("redis")
            self.sample(time.monotonic() - t0, "stop")
            time.sleep(2)
        self.roles.expected_exit |= {"learner"}
        others = ["buffer", *self.fleet]
        left_running = []
        deadline = time.monotonic() + 90
        while any(self.roles.alive(n) for n in others) and time.monotonic() < deadline:
            time.sleep(1)
        rcs = {n: self.roles.procs[n].returncode for n in others if n in self.roles.procs}
        for n in others:
            if self.roles.alive(n):
                left_running.append(n)
                self.roles.signal(n, signal.SIGTERM)
        self.tail_events()
        return {"final_max_steps": final_steps, "final_learner_rc": learner_rc, "exit_codes_at_stop": rcs,
                "roles_still_running_90s_after_stop": left_running, "stop_seconds": time.monotonic() - t_stop}


def _group(group_id: str, token: int = 5):
    from asyncrl.protocol import schema

    samples = [schema.Sample(completion_ids=schema.pack_i32([token, 6, 7]), logprobs=schema.pack_f32([-0.5] * 3),
                             versions=schema.pack_i32([0] * 3), reward=0.5, finish_reason="length")
               for _ in range(8)]
    return schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=group_id,
                                  prompt_id=group_id.split("@")[0], generator_id="chaos",
                                  prompt_ids=schema.pack_i32([13, 14, 15]), samples=samples,
                                  sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time())


def _head() -> str:
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else ""


def _reject_total(client, keys) -> int:
    return sum(int(float(v)) for k, v in client.hgetall(keys.metrics).items()
               if k.decode().startswith("buffer:reject:"))


# ---- figures after the run --------------------------------------------------------------------------

def stalls(rows: list[dict], injected: list[dict], t0_wall: float, t_end: float) -> dict:
    """Per fault: seconds to the learner's next step, and the learner's longest time without a step
    from the fault until the next fault (or the end of the soak). A step is any row, also one a later
    restart rolled back: the learner was moving."""
    times = sorted(r["time"] for r in rows)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if a >= t0_wall]
    per_fault, by_kind = [], {}
    for i, f in enumerate(injected):
        until = injected[i + 1]["t"] if i + 1 < len(injected) else t_end
        marks = [f["t"], *[t for t in times if f["t"] < t <= until]]
        after = [t for t in times if t > f["t"]]
        first = round(after[0] - f["t"], 1) if after else None
        tail = (after[0] if after and after[0] > until else until) - marks[-1]
        longest = round(max([b - a for a, b in zip(marks, marks[1:], strict=False)] + [tail]), 1)
        per_fault.append({"at_s": f["at_s"], "kind": f["kind"], "target": f["target"], "to_next_step_s": first,
                          "longest_no_step_s": longest, "window_s": round(until - f["t"], 1)})
        by_kind.setdefault(f["kind"], []).append(longest)
    summary = {k: {"n": len(v), "mean_s": round(statistics.fmean(v), 1), "max_s": max(v)}
               for k, v in sorted(by_kind.items())}
    return {"median_step_interval_s": round(statistics.median(gaps), 2) if gaps else None,
            "longest_step_gap_s": round(max(gaps), 1) if gaps else None,
            "per_fault": per_fault, "by_kind": summary}


def memory(samples: list[dict]) -> dict:
    """Least-squares slopes (bytes/minute): per role, over each process's life after its first
    SLOPE_SKIP_S; the role's longest-lived process is reported. Redis used_memory after SLOPE_SKIP_S."""
    samples = [s for s in samples if s.get("phase") == "soak"]  # not the stop, where roles shut down
    lives: dict[tuple[str, int], list] = {}
    for s in samples:
        for role, v in s["rss"].items():
            lives.setdefault((role, v["pid"]), []).append((s["t"], v["bytes"]))
    roles: dict[str, dict] = {}
    for (role, pid), pts in lives.items():
        pts = [p for p in pts if p[1] > 0]
        if not pts:
            continue
        kept = [p for p in pts if p[0] >= pts[0][0] + SLOPE_SKIP_S]
        span = (kept[-1][0] - kept[0][0]) / 60 if kept else 0.0
        entry = roles.setdefault(role, {"processes": 0})
        entry["processes"] += 1
        if span > entry.get("span_min", -1):
            entry.update(pid=pid, span_min=round(span, 1), rss_first_mb=round(pts[0][1] / 2**20, 1),
                         rss_last_mb=round(pts[-1][1] / 2**20, 1), slope_bytes_per_min=slope_per_min(kept))
    redis_pts = [(s["t"], s["redis_used_memory"]) for s in samples
                 if s.get("redis_used_memory") is not None and s["t"] >= SLOPE_SKIP_S]
    stream_pts = [(s["t"], s["trajectories"]) for s in samples
                  if s.get("trajectories") is not None and s["t"] >= SLOPE_SKIP_S]
    redis_slope = slope_per_min(redis_pts)
    entries_slope = slope_per_min(stream_pts)
    return {"skip_s": SLOPE_SKIP_S, "roles": roles,
            "redis_used_memory": {"slope_bytes_per_min": redis_slope,
                                  "first_mb": round(redis_pts[0][1] / 2**20, 2) if redis_pts else None,
                                  "last_mb": round(redis_pts[-1][1] / 2**20, 2) if redis_pts else None,
                                  "trajectory_entries_per_min": entries_slope,
                                  "bytes_per_trajectory_entry": (redis_slope / entries_slope
                                                                 if redis_slope and entries_slope else None)}}


def leftovers(sessions: set[int], seen: dict[int, float]) -> list[dict]:
    """Processes still alive that the soak started: in one of its roles' sessions, or met in a role's
    process tree while sampling (same pid and start time: an orphaned engine core or learner rank)."""
    import psutil

    out = []
    for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
        try:
            ours = os.getsid(p.pid) in sessions or seen.get(p.pid) == p.info["create_time"]
            if ours and p.status() != psutil.STATUS_ZOMBIE:
                out.append({"pid": p.pid, "cmdline": " ".join(p.info["cmdline"] or [])[:200]})
        except (psutil.Error, ProcessLookupError):
            continue
    return out


def log_findings(logs: Path) -> dict:
    out = {}
    for f in sorted(logs.glob("*.log")):
        text = f.read_text(errors="replace")
        out[f.stem] = {"tracebacks": text.count("Traceback (most recent call last)"),
                       "starts": text.count("===== chaos soak: start"),
                       "redis_unreachable": text.count("REDIS UNREACHABLE"), "stall_lines": text.count("STALL ")}
    return out


def print_table(result: dict) -> None:
    a, checks = result["audit"], result["audit"]["checks"]
    p, t, ln = a["prompts"], a["trajectories"], a["learner"]
    print("\n== chaos soak: audit ==")
    rows = [
        ("prompts released", p["released"]),
        ("released, stored as a group", p["fate"].get("stored", 0)),
        ("released, leased at stop / never leased", f"{p['fate'].get('leased_at_stop', 0)} / "
                                                     f"{p['fate'].get('unleased_at_stop', 0)}"),
        ("groups trained into the saved model", ln["saved_model_history"]["groups_trained"]),
        ("groups acked - dropped (by count)", ln["trained_by_count"]),
        ("dropped as stale / ahead", ln["dropped_stale_or_ahead"]),
        ("quarantined (poison entries)", a["quarantine"]["entries"]),
        ("stored, unread / unacked at stop", f"{t['learner_side'].get('unread_at_stop', 0)} / "
                                             f"{t['learner_side'].get('delivered_not_acked_at_stop', 0)}"),
        ("ingest poison frames sent / refused", f"{a['quarantine']['ingest_frames_sent_total']} / "
                                                f"{a['quarantine']['buffer_reject_total']}"),
        ("duplicates", checks["duplicates"]), ("lost", checks["lost"]),
        ("saved history contiguous, monotonic", checks["saved_history_contiguous_and_monotonic"]),
        ("learner steps (saved history / rows written)", f"{ln['saved_model_history']['steps']} / "
                                                         f"{ln['saved_model_history']['rows_written']}"),
        ("crashes (unplanned exits)", len(result["crashes"])),
        ("processes left", len(result["processes_left"])),
    ]
    for name, v in rows:
        print(f"  {name:<46} {v}")
    print("== memory slope after warm-up (MB/min) ==")
    for role, m in sorted(result["memory"]["roles"].items()):
        s = m.get("slope_bytes_per_min")
        print(f"  {role:<10} {'n/a' if s is None else f'{s / 2**20:+.3f}':>8}  over {m['span_min']:.1f} min, "
              f"{m['processes']} process(es), {m['rss_first_mb']:.0f} -> {m['rss_last_mb']:.0f} MB")
    r = result["memory"]["redis_used_memory"]
    s = r["slope_bytes_per_min"]
    print(f"  {'redis mem':<10} {'n/a' if s is None else f'{s / 2**20:+.3f}':>8}  used_memory {r['first_mb']} -> "
          f"{r['last_mb']} MB")
    print("== learner without a step after each fault (longest, s) ==")
    st = result["stalls"]
    print(f"  median step interval {st['median_step_interval_s']}s, longest gap {st['longest_step_gap_s']}s")
    for kind, v in st["by_kind"].items():
        print(f"  {kind:<16} n={v['n']:<3} mean={v['mean_s']:>6}s max={v['max_s']:>6}s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0, help="soak length, from the first learner step")
    ap.add_argument("--seed", type=int, default=1, help="the fault schedule's seed")
    ap.add_argument("--mean-gap", type=float, default=65.0, help="mean seconds between faults")
    ap.add_argument("--kinds", default=",".join(KINDS), help="the fault kinds drawn from, comma-separated")
    ap.add_argument("--dir", default="/tmp/chaos-soak", help="work folder (emptied first)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--commit", default="", help="the commit the code is, for the results (default: git HEAD)")
    ap.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    args = ap.parse_args()
    from benchmarks.chaos_audit import audit

    soak = Soak(args)
    result: dict = {"benchmark": "chaos_soak", "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "code": args.commit or _head(),
                    "seed": args.seed, "minutes": args.minutes, "mean_gap_s": args.mean_gap,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "config_overrides": CONFIG + list(args.overrides),
                    "schedule": [asdict(f) for f in soak.schedule]}
    try:
        result.update(soak.run())
        if not soak.roles.alive("redis"):
            soak.roles.start("redis")
            time.sleep(2)
        soak.client = None
        result["audit"] = audit(soak.redis(), soak.keys, soak.cfg.run_dir, soak.poison)
        identity = {k.decode(): v.decode() for k, v in soak.redis().hgetall(soak.keys.identity).items()}
        from learners.checkpoint import latest

        ckpt = latest(soak.cfg.checkpoint_dir)
        meta = json.loads((ckpt / "meta.json").read_text()) if ckpt else {}
        result["final"] = {"identity_state": identity.get("state"), "identity_version": identity.get("version"),
                           "checkpoint": str(ckpt), "checkpoint_step": meta.get("step"),
                           "checkpoint_version": meta.get("version"),
                           "hf_final": (soak.cfg.run_dir / "hf-final" / "model.safetensors").exists()}
        soak.tail_events()
        soak.roles.signal("redis", signal.SIGTERM)
    finally:
        for name in list(soak.roles.procs):  # anything of ours still up after a failure
            soak.roles.signal(name, signal.SIGCONT, expect_exit=False)
            soak.roles.signal(name, signal.SIGTERM)
        time.sleep(10)
        result["processes_left"] = leftovers(soak.roles.sessions, soak.seen)
        for p in result["processes_left"]:
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    rows = soak.rows()
    result["injected"] = soak.injected
    result["crashes"] = soak.crashes
    result["stalls"] = stalls(rows, soak.injected, result["soak_started_at"], result["soak_ended_at"])
    result["memory"] = memory(soak.samples)
    result["logs"] = log_findings(soak.work / "logs")
    kinds: dict[str, int] = {}
    for e in soak.events:
        kinds[e.get("kind", "?")] = kinds.get(e.get("kind", "?"), 0) + 1
    result["events_by_kind"] = dict(sorted(kinds.items()))
    result["scale_down_exits"] = [h for h in soak.roles.history if "rc" in h and h["role"] in
                                  {f.target for f in soak.schedule if f.kind == "scale_down"}]
    result["role_history"] = soak.roles.history
    (soak.work / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in soak.events))
    (soak.work / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in soak.samples))
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    checks = result["audit"]["checks"]
    return 0 if checks["duplicates"] == 0 and checks["lost"] == 0 and not result["processes_left"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
