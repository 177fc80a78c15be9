"""`asyncrl run`: Redis, buffer, generators and learner on one machine, supervised.

Each child runs in its own process session so that teardown can signal its whole tree (vLLM's engine
core, torchrun's ranks), pinned to its role's CPUs when `{generator,learner,buffer}.cpus` say so, or
to CPUs the launcher picks on a small machine (`run.affinity=auto`; asyncrl/launch/affinity.py: set
before exec, inherited by the whole tree). Ctrl-C, SIGTERM or the first child failure tears everything
down: SIGTERM, a grace period, then SIGKILL for whatever is left. Nothing outlives the launcher.

Start-up: nothing waits for another role's readiness. The generators and the learner are spawned at
once; when the tiny model has to be written, the first of them to reach `ensure_model` writes it
(the learner, whose imports take less time than vLLM's) while the generator imports vLLM, and the other
waits on the lock. The buffer reads the model's vocabulary size at start, so it is spawned as soon
as the model is there (at once with `model.path` set).
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncrl.config import Config, dump_yaml
from asyncrl.launch import affinity
from asyncrl.launch.redis_server import LocalRedis, free_port

log = logging.getLogger(__name__)
# Set for the learner by `asyncrl run`: how many generators engines share the learner's first GPU.
LOCAL_ENGINES_ENV = "ASYNCRL_LOCAL_ENGINES"

GRACE_S = 20.0


def ensure_model(cfg: Config) -> str:
    """Writes the tiny model when `model.path` is empty; safe when several roles race to do it."""
    write_model_if_missing(cfg)
    return cfg.model_path


def write_model_if_missing(cfg: Config) -> bool:
    """`ensure_model`; True when this process wrote the tiny model (and so ran torch: its warm start)."""
    if cfg.model.path:
        return False
    path = Path(cfg.model_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".tiny-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "model.safetensors").exists():
            return False
        from asyncrl.tools.tiny_model import write_tiny_model

        log.info("writing tiny model to %s (warm start %d steps)", path, cfg.model.tiny.warm_start_steps)
        write_tiny_model(path, seed=cfg.run.seed, warm_start_steps=cfg.model.tiny.warm_start_steps,
                         warm_start_lr=cfg.model.tiny.warm_start_lr,
                         copy_len=(cfg.data.min_len, cfg.data.max_len),
                         max_positions=max(512, cfg.generator.max_model_len), **cfg.tiny_shape())
        return True


def model_ready(cfg: Config) -> bool:
    """Whether `ensure_model` would return at once: a `model.path` is set, or the tiny model is written
    and nobody holds its lock (no write under way)."""
    if cfg.model.path:
        return True
    path = Path(cfg.model_path)
    if not (path / "model.safetensors").exists():
        return False
    with open(path.parent / ".tiny-model.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(lock, fcntl.LOCK_UN)
    return True


def local_weights_backend(cfg: Config) -> str:
    """`weights.backend` for the roles this launcher starts on one host: kept as set. `auto` is gloo
    on CPU and, on CUDA, ipc: every local role opens GPU 0, where NCCL cannot hold the learner's rank
    and a vLLM worker ("Duplicate GPU detected"), while CUDA IPC handles share the learner's buckets
    in GPU memory (the learner picks it per epoch from the members' node ids, `choose_backend`)."""
    if cfg.weights.backend == "auto":
        log.info("weights.backend=auto: gloo on CPU, ipc on CUDA (the roles share the host's GPU memory)")
    return cfg.weights.backend


def learner_command(cfg: Config, config_path: str | None, overrides: list[str]) -> list[str]:
    """torchrun on one node, through asyncrl.launch.listen: its rendezvous store listens on 127.0.0.1 only
    (torchrun's own binds every interface whatever --master-addr says)."""
    args = [config_path] if config_path else []
    return [sys.executable, "-m", "asyncrl.launch.listen", "--nnodes", "1",
            "--nproc-per-node", str(cfg.learner.nproc), "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "-m", "learners.main", *args, *overrides]


def check_resumable(cfg: Config, client, keys) -> None:
    """run.resume=true on a run that trained past version 0 needs a complete checkpoint to go on from:
    without one the learner would start again at version 0 with the first weights while the run's
    Redis state (its trajectories, its generators' versions) is that of the later version, and wait
    for a weight group that never forms. Refused here in one line, before any role starts."""
    from asyncrl.config import ConfigError

    ident = client.hgetall(keys.identity)
    version = int(client.get(keys.version) or ident.get(b"version") or 0)
    root = cfg.checkpoint_dir
    # learners/checkpoint.py: a checkpoint counts once its COMPLETE marker is written.
    saved = sorted(p.name for p in root.glob("step-*") if (p / "COMPLETE").exists()) if root.exists() else []
    if version == 0 or (saved and cfg.checkpoint.resume != "never"):
        return
    why = ("checkpoint.resume=never ignores its checkpoints" if saved else
           f"{root} holds no complete checkpoint (checkpoint.every={cfg.checkpoint.every})")
    raise ConfigError(f"run.resume=true: run {cfg.run.name!r} reached version {version} but {why}, so there is "
                      "nothing to continue from; start afresh with run.reset=true (or another run.name), and "
                      "set checkpoint.every=N to make a run resumable")


class Launcher:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.children: dict[str, subprocess.Popen] = {}
        self.redis: LocalRedis | None = None
        self._interrupted = False

    def _spawn(self, name: str, argv: list[str], log_to_file: bool = True, role: str | None = None) -> None:
        out = None
        if log_to_file:
            (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
            out = open(self.run_dir / "logs" / f"{name}.log", "ab")
        cpus = affinity.cpus_of(self.cfg, role) if role else ()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(affinity.role_env(self.cfg, role) if role else {})}
        if role == "learner":  # its rank 0 shares the first GPU with this launcher's engines: size around them
            env[LOCAL_ENGINES_ENV] = str(self.cfg.generator.num_generators)
        self.children[name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT if out else None,
                                               start_new_session=True, env=env, preexec_fn=affinity.preexec(cpus))
        pinned = f", cpus {affinity.format_cpus(cpus)}" if cpus else ""
        log.info("started %s (pid %d%s)", name, self.children[name].pid, pinned)

    def _on_signal(self, signum, _frame) -> None:
        self._interrupted = True
        log.warning("received signal %d: tearing the run down", signum)

    def run(self) -> int:
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            return self._run()
        finally:
            self.teardown()

    def _pin_roles(self) -> None:
        """run.affinity=auto on a small machine: the roles' CPUs, written into the config the children read."""
        split, line = affinity.auto_assignment(self.cfg)
        for role, cpus in (split or {}).items():
            getattr(self.cfg, role).cpus = affinity.format_cpus(cpus)
        print(line, flush=True)

    def _run(self) -> int:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._pin_roles()  # before the local redis-server, which follows buffer.cpus
        if not cfg.buffer.redis_url:
            self._start_local_redis()
        from asyncrl.protocol.keys import Keys, connect

        client = connect(cfg.buffer.redis_url)
        keys = Keys(cfg.run.name)
        self._stop_key = (cfg.buffer.redis_url, keys.stop)  # set at teardown: the run is over
        if cfg.run.resume:
            check_resumable(cfg, client, keys)
        else:
            self._set_aside_earlier_run(client)
        self._claim_run(client, keys)
        cfg.weights.backend = local_weights_backend(cfg)
        cfg_path = self.run_dir / "config.yaml"
        cfg_path.write_text(dump_yaml(cfg))
        buffer_argv = self._spawn_roles(cfg_path)
        return self._supervise(client, keys, cfg_path, buffer_argv)

    def _start_local_redis(self) -> None:
        from asyncrl.protocol.security import redis_password

        cfg = self.cfg
        self.redis = LocalRedis(self.run_dir / "redis", appendfsync=cfg.buffer.appendfsync,
                                password=redis_password(), cpus=affinity.cpus_of(cfg, "buffer")).start()
        cfg.buffer.redis_url = self.redis.address_url  # the password, if any, stays in its file
        log.info("local redis-server at %s (AOF, appendfsync=%s)", self.redis.url, cfg.buffer.appendfsync)

    def _set_aside_earlier_run(self, client) -> None:
        """A fresh run: state left in this Redis by an earlier run of the same name would make the
        learner start at that run's version with fresh weights; its metrics and checkpoints are kept aside."""
        cfg = self.cfg
        stale = list(client.scan_iter(f"asyncrl:{cfg.run.name}:*", count=1000))
        if stale:
            log.warning("fresh run: clearing %d keys of an earlier run named %r (run.resume=true keeps them)",
                        len(stale), cfg.run.name)
            client.delete(*stale)
        stamp = int(time.time())
        for name in ("metrics", "metrics.rolled_back", "eval", "eval_samples"):
            if (self.run_dir / f"{name}.jsonl").exists():
                (self.run_dir / f"{name}.jsonl").rename(self.run_dir / f"{name}.{stamp}.jsonl")
        if (self.run_dir / "plots").is_dir():  # drawn from the earlier run's rows: stale once this one starts
            (self.run_dir / "plots").rename(self.run_dir / f"plots.{stamp}")
        if cfg.checkpoint_dir.exists() and not cfg.checkpoint.dir:
            # A fresh run must not resume an earlier run's checkpoints; keep them aside.
            cfg.checkpoint_dir.rename(cfg.checkpoint_dir.with_name(f"checkpoints.{stamp}"))

    def _claim_run(self, client, keys) -> None:
        from asyncrl.observe import timeline
        from asyncrl.protocol.identity import claim

        claim(client, keys, self.cfg, "launcher")  # a fresh run creates its identity; run.resume continues a finished one
        client.delete(keys.stop)
        client.delete(keys.timeline)  # a resumed run's start-up is this launch's, not the first one's
        timeline.mark(client, keys, "launch", timeline.process_start())

    def _spawn_roles(self, cfg_path: Path) -> list[str]:
        """Starts the generators, the learner and (once the model is there) the buffer; returns the
        buffer's command line, for a buffer that starts later."""
        cfg = self.cfg
        py = [sys.executable, "-m", "asyncrl"]
        # No role waits for another here (see the module docstring): each role's entry point writes the
        # tiny model if it is missing (ensure_model, under a lock) or waits for the one writing it.
        buffer_argv = [*py, "buffer", str(cfg_path)]
        if model_ready(cfg):
            self._spawn("buffer", buffer_argv, role="buffer")
        for i in range(cfg.generator.num_generators):
            self._spawn(f"generator-g{i}", [*py, "generator", str(cfg_path), "--id", f"g{i}"], role="generator")
        self._spawn("learner", learner_command(cfg, str(cfg_path), []), log_to_file=False, role="learner")
        print(f"asyncrl run: {cfg.run.name} in {self.run_dir} | {cfg.generator.num_generators} generator(s), "
              f"{cfg.learner.nproc} learner rank(s), {cfg.run.max_steps} steps | logs in {self.run_dir}/logs",
              flush=True)
        if cfg.run.purpose:
            print(f"purpose: {cfg.run.purpose}", flush=True)
        return buffer_argv

    def _supervise(self, client, keys, cfg_path: Path, buffer_argv: list[str]) -> int:
        """Polls the children until the learner finishes (0), a role fails (1), the run stalls under
        run.on_stall=fail (3) or a signal comes (130)."""
        from asyncrl.launch.elastic import LocalScaler
        from asyncrl.observe.watchdog import launcher_watchdog

        cfg = self.cfg
        watchdog = launcher_watchdog(cfg, keys)  # None when run.stall_timeout_s is 0
        scaler = LocalScaler(self, client, keys, cfg_path)  # `asyncrl scale`: start/stop generator children
        while True:
            if self._interrupted:
                return 130
            if watchdog is not None and watchdog.poll() and cfg.run.on_stall == "fail":
                log.error("run.on_stall=fail: stopping the stalled run")
                return 3
            scaler.poll()
            if "buffer" not in self.children and model_ready(cfg):
                self._spawn("buffer", buffer_argv, role="buffer")
            code = self.children["learner"].poll()
            if code is not None:
                if code != 0:
                    log.error("learner exited with %d", code)
                    return 1
                self._wait_others_exit()
                print(f"asyncrl run: done; metrics in {self.run_dir / 'metrics.jsonl'}", flush=True)
                if cfg.run.purpose:
                    print(f"purpose: {cfg.run.purpose}", flush=True)
                return 0
            if self._other_role_failed(scaler.removed):
                return 1
            time.sleep(0.2)

    def _other_role_failed(self, removed) -> bool:
        """Whether a role other than the learner (and not one `asyncrl scale` removed) failed; exit 0 is
        an orderly leave (the stop key, or a drained generator), only failures stop the run."""
        for name, child in self.children.items():
            if name != "learner" and name not in removed and (code := child.poll()) is not None and code != 0:
                log.error("%s exited with %d (see %s/logs/%s.log): stopping the run", name, code,
                          self.run_dir, name)
                return True
        return False

    def _wait_others_exit(self) -> None:
        """After the learner finished it set the stop key; give the others a moment to leave cleanly."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children.values()):
            time.sleep(0.2)

    def _mark_run_over(self) -> None:
        """Sets the run's `stop` key before the SIGTERMs, so generators leave at once (in-flight
        groups handed back) instead of draining toward a buffer that is going down too (which held
        Ctrl-C for the whole grace period). Best effort: one quick try, no retries."""
        if getattr(self, "_stop_key", None) is None:
            return
        import redis

        from asyncrl.protocol.keys import _auth_kwargs

        url, key = self._stop_key
        try:
            redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1, retry=None,
                                 **_auth_kwargs()).set(key, f"{time.time():.3f}")
        except (redis.RedisError, OSError) as e:
            log.info("could not mark the run over in Redis (%s): generators drain instead", e)

    def teardown(self) -> None:
        alive = {n: c for n, c in self.children.items() if c.poll() is None}
        if alive:
            self._mark_run_over()
        for name, child in alive.items():
            _unpin_tree(child.pid)
            if name.startswith("generator-"):
                # Only the generator itself: it shuts its vLLM engine down in order (engine core, then
                # worker). A SIGTERM to the worker as well ended it under a request or weight load the
                # engine core then waited on until vLLM's 5 s shutdown timeout killed it.
                os.kill(child.pid, signal.SIGTERM)
            else:
                _signal_group(child, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(c.poll() is None for c in alive.values()):
            time.sleep(0.1)
        for child in self.children.values():
            # SIGKILL the whole session even if its leader already exited: grandchildren may remain.
            _signal_group(child, signal.SIGKILL)
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("pid %d did not die", child.pid)
        if self.redis:
            self.redis.stop()


def _unpin_tree(pid: int) -> None:
    """Gives a pinned role's whole tree every CPU this launcher may use before it is told to leave.
    Why: vLLM's engine core, its worker and the generator shutting down together on one pinned CPU
    (run.affinity=auto on 2 CPUs) took over 5 s, so vLLM's own shutdown timeout killed the engine
    core; with both CPUs the same teardown takes about 2.5 s."""
    import psutil

    allowed = os.sched_getaffinity(0)
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            tids = [t.id for t in p.threads()]  # affinity is per thread: each of its threads
        except psutil.Error:
            continue
        for tid in tids:
            try:
                os.sched_setaffinity(tid, allowed)
            except OSError:  # the thread or process is gone
                pass


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    """Signals the child's session and every descendant: torchrun starts its ranks in sessions of
    their own, so a session-wide kill alone would leave them running."""
    kill_tree(child.pid, sig)


def kill_tree(pid: int, sig: int) -> None:
    """Signals `pid`'s process group (when `pid` leads one) and each descendant outside it, once each:
    a second SIGTERM to a process already handling the first cut its way out short (torchrun's agent
    printed a traceback from inside its logging; the buffer left without draining)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    try:
        os.killpg(pid, sig)
        group = pid
    except (ProcessLookupError, PermissionError):
        group = None
    for p in procs:
        try:
            if group is None or os.getpgid(p.pid) != group:
                p.send_signal(sig)
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
