"""`asyncrl submit ray`: the run as a Ray job; the driver lives here too.

`submit_ray` runs `ray job submit --address ADDR -- python -m asyncrl.launch.deploy_ray driver CONFIG ...`,
which streams the job's logs until it ends (the Python environment and the run directory are on a
filesystem all Ray nodes share, as with Slurm; the roles run in the directory the run was submitted
from, so a config's relative paths mean what they meant there). The driver:
- places each role with a placement group: the core (Redis + buffer, asyncrl/launch/deploy_core.py), the
  learner (one bundle per node, STRICT_SPREAD, a torchrun per bundle), one group per generator;
- runs each role's ordinary entry point as a subprocess of a `RoleActor`, whose output goes to
  the driver's log (and so to `ray job submit`'s stream);
- restarts a generator whose actor or process dies (Ray's `max_restarts` re-runs the actor, which
  re-spawns the generator; a process that exits non-zero is re-spawned by the driver);
- watches the run's `scale` list (`asyncrl scale`): +K starts actors, -K drains the newest.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger(__name__)

IMPORT_ROOT = Path(__file__).resolve().parents[2]  # the folder asyncrl is imported from: a checkout or site-packages
NAMESPACE = "asyncrl"


ROLES = ("core", "learner", "generator")  # the roles whose bundles `--{role}-resources` can steer


def _sum_resources(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for extra, count in parts:
        for k, v in extra.items():
            total[k] = total.get(k, 0.0) + v * count
    return total


def parse_resources(text: str) -> dict[str, float]:
    """`--{core,learner,generator}-resources`: a JSON object of custom Ray resource names to positive amounts
    (CPU and GPU have options of their own); ValueError with one line otherwise."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f'expected an object like {{"inference": 1}}, got {text!r}')
    out = {}
    for name, amount in value.items():
        if name in ("CPU", "GPU"):
            raise ValueError(f"{name} is set by --cpus-per-role / --gpus-per-node, not here")
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not amount > 0:
            raise ValueError(f"{name!r} must be a positive number, got {amount!r}")
        out[str(name)] = float(amount)
    return out


def submit_ray(cfg, address: str, num_generators: int, cpus_per_role: float = 1.0, gpus_per_node: int = 0,
               learner_nodes: int = 1, wait: bool = True, resources: dict[str, dict[str, float]] | None = None) -> int:
    """`resources`: role ("core", "learner", "generator") -> custom Ray resources its bundles also reserve."""
    from asyncrl.config import dump_yaml

    exe = shutil.which("ray") or str(Path(sys.executable).parent / "ray")
    if not Path(exe).exists():
        print("asyncrl submit ray: the `ray` CLI is missing: pip install 'asyncrl[ray]'", file=sys.stderr)
        return 1
    run_dir = cfg.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.yaml"
    config_path.write_text(dump_yaml(cfg))
    argv = [exe, "job", "submit", "--address", address, "--submission-id", f"asyncrl-{cfg.run.name}-{int(time.time())}"]
    if not wait:
        argv.append("--no-wait")
    argv += ["--", sys.executable, "-m", "asyncrl.launch.deploy_ray", "driver", str(config_path),
             "--cwd", os.getcwd(), "--generators", str(num_generators), "--cpus-per-role", str(cpus_per_role),
             "--gpus-per-node", str(gpus_per_node), "--learner-nodes", str(learner_nodes)]
    for role, extra in (resources or {}).items():
        if extra:
            argv += [f"--{role}-resources", json.dumps(extra)]
    print("asyncrl submit ray:", " ".join(argv), file=sys.stderr, flush=True)
    res = subprocess.run(argv)
    return res.returncode


# ---- the driver (runs inside the Ray job) -------------------------------------------------------------


def _role_actor_class():
    import ray

    @ray.remote(max_restarts=-1, max_task_retries=0)
    class RoleActor:
        """Runs one role's entry point as a subprocess; dies with it never silently (poll() says)."""

        def __init__(self, name: str, argv: list[str], env: dict[str, str], cwd: str):
            import ray

            self.name, self.argv, self.env, self.cwd = name, argv, env, cwd
            self.proc = None
            # Every process of the role (its children too: torchrun's ranks, which torch starts in
            # sessions of their own, the core's redis-server) carries this tag; a reaper outside
            # the actor ends them all once the actor is gone (`ray job stop`, a killed actor).
            self.env = {**env, ROLE_TAG: f"{name}-{os.getpid()}-{int(time.time() * 1000)}"}
            start_reaper(os.getpid(), self.env[ROLE_TAG])
            # Restarted by Ray (its node or process died): a generator comes back under a fresh id, so
            # the learner sees a new member and opens a weight-group epoch for it.
            self.spawn(fresh_id=ray.get_runtime_context().was_current_actor_reconstructed)

        def spawn(self, fresh_id: bool = False) -> int:
            import ctypes
            import signal

            if fresh_id and "--id" in self.argv:
                i = self.argv.index("--id") + 1
                self.argv[i] = f"{self.argv[i].split('r')[0]}r{int(time.time() * 1000) % 10**8}"

            def die_with_actor():  # the role must not outlive a killed actor (Linux: PR_SET_PDEATHSIG)
                # SIGTERM, not SIGKILL: the role leaves in its own bounded time and takes its own
                # children with it (the core its redis-server and buffer, torchrun its ranks, a
                # generator its engine); a SIGKILL would leave those behind (`ray job stop`).
                ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)

            self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
                                         cwd=self.cwd, preexec_fn=die_with_actor)
            print(f"[{self.name}] started pid {self.proc.pid}: {' '.join(self.argv)}", flush=True)
            return self.proc.pid

        def poll(self):
            return self.proc.poll()

        def pid(self) -> int:
            return os.getpid()

        def terminate(self) -> None:
            """SIGTERM to the role only: a generator drains, then exits 0."""
            if self.proc.poll() is None:
                self.proc.terminate()

        def kill(self) -> None:
            from asyncrl.launch.launcher import kill_tree

            kill_tree(self.proc.pid, 9)

    return RoleActor


ROLE_TAG = "ASYNCRL_ROLE_TAG"
REAP_GRACE_S = 20.0  # after SIGTERM, what is left of a gone actor's role is SIGKILLed


def tagged_processes(tag: str) -> list[int]:
    """Pids of the processes whose environment carries ROLE_TAG=tag."""
    needle = f"{ROLE_TAG}={tag}".encode() + b"\0"
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes() + b"\0":
                pids.append(int(d.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def start_reaper(watched_pid: int, tag: str) -> None:
    """A process outside the actor (Ray kills an exiting worker's direct children with SIGKILL,
    which their own children survive) that waits for `watched_pid` to end, then sends SIGTERM to
    every process tagged `tag` (each leaves in its own bounded time), and SIGKILL to what is left
    after REAP_GRACE_S."""
    env = {k: v for k, v in os.environ.items() if k != ROLE_TAG}
    subprocess.Popen([sys.executable, "-m", "asyncrl.launch.deploy_ray", "reap", str(watched_pid), tag], cwd="/",
                     env={**env, "PYTHONPATH": str(IMPORT_ROOT)}, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _reap(watched_pid: int, tag: str) -> None:
    import signal

    if os.fork() > 0:  # the parent returns at once: the reaper is nobody's child in the actor's tree
        os._exit(0)
    while True:
        try:
            os.kill(watched_pid, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            pass
        time.sleep(0.5)
    for sig, wait_s in ((signal.SIGTERM, REAP_GRACE_S), (signal.SIGKILL, 5.0)):
        pids = tagged_processes(tag)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = tagged_processes(tag)
        if not pids:
            return


PLACE_TIMEOUT_S = float(os.environ.get("ASYNCRL_RAY_PLACE_TIMEOUT_S", "120"))


class PlacementTimeout(RuntimeError):
    """A placement group the cluster could not place in time (busy, or too small for one bundle)."""


def _fmt(resources: dict) -> str:
    return " ".join(f"{k}={v:g}" for k, v in sorted(resources.items())) or "nothing"


def shortfall(needs: dict[str, float], cluster: dict[str, float]) -> str | None:
    """What `needs` asks beyond what the cluster has in total (one line), or None when it fits."""
    short = {k: v for k, v in needs.items() if v > cluster.get(k, 0.0) + 1e-9}
    if not short:
        return None
    has = {k: cluster.get(k, 0.0) for k in needs}
    return f"the run needs {_fmt({k: v for k, v in needs.items() if v})}; the cluster has {_fmt(has)}"


LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::")


def node_bind_overrides(cfg: Config, ip: str) -> list[str]:
    """Where a role that Ray placed listens. Ray picks the node, so an interface address named in the
    config can be right on one node only: it becomes the role's own node's address as Ray knows it
    (`ray start --node-ip-address`). Loopback stays (a one-node cluster); a wildcard stays and
    publishes the node's address, unless deploy.advertise_host names one."""
    out = [f"{key}={ip}" for key, host in (("deploy.bind_host", cfg.deploy.bind_host),
                                            ("buffer.bind_host", cfg.buffer.bind_host))
           if host not in LOOPBACK and host not in WILDCARD]
    if not cfg.deploy.advertise_host and any(h in WILDCARD for h in (cfg.deploy.bind_host, cfg.buffer.bind_host)):
        out.append(f"deploy.advertise_host={ip}")
    return out


def learner_argv(cfg: Config, num_nodes: int, head: str, port: int, config_path: str, redis_url: str) -> list[str]:
    """One learner node's torchrun, through asyncrl.launch.listen: the rendezvous store listens on `head`
    only (loopback on one node, the node's address as Ray knows it otherwise), not on every interface."""
    return [sys.executable, "-m", "asyncrl.launch.listen", "--nnodes", str(num_nodes),
            "--nproc-per-node", str(cfg.learner.nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{head}:{port}", "--rdzv-id", f"asyncrl-{cfg.run.name}",
            "-m", "learners.main", config_path, f"buffer.redis_url={redis_url}"]


class RayDriver:
    def __init__(self, config_path: str, num_generators: int, cpus_per_role: float, gpus_per_node: int,
                 learner_nodes: int, resources: dict[str, dict[str, float]] | None = None):
        import ray

        from asyncrl.config import load_config

        self.ray = ray
        self.config_path = config_path
        self.cwd = os.getcwd()  # where every role runs: the directory the run was submitted from (--cwd)
        self.cfg = load_config(config_path)
        self.cpus, self.gpus, self.learner_nodes = cpus_per_role, gpus_per_node, learner_nodes
        # role -> custom Ray resources of each of its bundles (`--{role}-resources`): which nodes may hold it
        self.resources = {role: dict((resources or {}).get(role) or {}) for role in ROLES}
        self.Actor = _role_actor_class()
        self.generators: dict[str, tuple] = {}  # id -> (actor, placement group)
        self.draining: set[str] = set()
        self.num_restarts = 0
        self._next = 0
        self.num_generators = num_generators

    def needs(self) -> dict[str, float]:
        """What the whole run asks of the cluster: the core, the learner nodes and the generators."""
        gen_gpus = self.cfg.generator.tensor_parallel_size if self.gpus else 0
        return {"CPU": self.cpus * (1 + self.learner_nodes + self.num_generators),
                "GPU": float(self.gpus * self.learner_nodes + gen_gpus * self.num_generators),
                **_sum_resources([(self.resources["core"], 1), (self.resources["learner"], self.learner_nodes),
                                  (self.resources["generator"], self.num_generators)])}

    def _place(self, bundles: list[dict], strategy: str = "PACK"):
        """A placement group, ready within PLACE_TIMEOUT_S; else PlacementTimeout, saying what is free."""
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group(bundles, strategy=strategy)
        try:
            self.ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            wanted = {k for b in bundles for k in b}
            free = {k: v for k, v in self.ray.available_resources().items() if k in wanted}
            raise PlacementTimeout(f"bundles {bundles} ({strategy}) could not be placed within {PLACE_TIMEOUT_S:.0f}s; "
                                   f"the cluster has free {_fmt(free)}") from None
        return pg

    def _actor(self, name: str, argv: list[str], pg, bundle: int = 0, env: dict | None = None):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        return self.Actor.options(name=f"asyncrl-{self.cfg.run.name}-{name}", namespace=NAMESPACE,
                                  num_cpus=self.cpus, num_gpus=0, scheduling_strategy=strategy,
                                  lifetime=None).remote(name, argv, env or {}, self.cwd)

    def _bundle_ip(self, pg, bundle: int = 0) -> str:
        """The address (as Ray knows it) of the node that holds bundle `bundle` of a ready placement group."""
        node_id = self.ray.util.placement_group_table(pg)["bundles_to_node_id"][bundle]
        return next(n["NodeManagerAddress"] for n in self.ray.nodes() if n["NodeID"] == node_id)

    def _bundle(self, gpus: int = 0, extra: dict[str, float] | None = None) -> dict:
        return {"CPU": self.cpus, **({"GPU": gpus} if gpus else {}), **(extra or {})}

    def start_generator(self) -> str:
        gid = f"g{self._next}"
        self._next += 1
        gpus = self.cfg.generator.tensor_parallel_size if self.gpus else 0
        pg = self._place([self._bundle(gpus, self.resources["generator"])])
        argv = [sys.executable, "-m", "asyncrl", "generator", self.config_path, f"buffer.redis_url={self.redis_url}",
                "--id", gid]
        self.generators[gid] = (self._actor(f"gen-{gid}", argv, pg), pg)
        return gid

    def run(self) -> int:
        from asyncrl.protocol.keys import Keys, connect

        cfg = self.cfg
        # Fail fast: a run the cluster cannot hold would wait for its last placement group forever.
        problem = shortfall(self.needs(), self.ray.cluster_resources())
        if problem:
            print(f"asyncrl ray driver: {problem} (--cpus-per-role {self.cpus:g}: the core, "
                  f"{self.learner_nodes} learner node(s), {self.num_generators} generator(s))", file=sys.stderr,
                  flush=True)
            return 2
        core = self._start_core()
        if core is None:
            return 1
        client, keys = connect(self.redis_url), Keys(cfg.run.name)
        learner_pg = self._place([self._bundle(self.gpus, self.resources["learner"])] * self.learner_nodes,
                                 "STRICT_SPREAD" if self.learner_nodes > 1 else "PACK")
        learners = self._start_learner(learner_pg)
        for _ in range(self.num_generators):
            self.start_generator()
        print(f"asyncrl ray driver: {cfg.run.name}: core, {self.learner_nodes} learner node(s), "
              f"{self.num_generators} generator(s); redis {self.redis_url}", flush=True)
        code = self._supervise(core, learners, client, keys)
        print(f"asyncrl ray driver: learner exited with {code}; generators restarted {self.num_restarts} time(s)",
              flush=True)
        self._teardown(core, learners)
        return 0 if code == 0 else 1

    def _start_core(self):
        """The core actor (Redis + buffer) once it published the run's Redis address (`self.redis_url`);
        None when it failed before that (its placement group is removed)."""
        from asyncrl.launch.deploy_core import wait_redis_url
        from asyncrl.protocol.security import redis_url_file

        cfg = self.cfg
        redis_url_file(cfg.run_dir).unlink(missing_ok=True)
        core_pg = self._place([self._bundle(0, self.resources["core"])])
        core = self._actor("core", [sys.executable, "-m", "asyncrl.launch.deploy_core", "core", self.config_path,
                                    *node_bind_overrides(cfg, self._bundle_ip(core_pg)), "--backend", "ray",
                                    "--wait-for-driver"], core_pg)
        try:
            self.redis_url = wait_redis_url(cfg.run_dir, exit_code=lambda: self.ray.get(core.poll.remote(), timeout=30))
        except (RuntimeError, TimeoutError) as e:
            print(f"asyncrl ray driver: {e}", file=sys.stderr, flush=True)
            self.ray.kill(core, no_restart=True)
            self.ray.util.remove_placement_group(core_pg)  # its CPUs are free at once, not at the job's end
            return None
        return core

    def _supervise(self, core, learners: list, client, keys):
        """Until the learner exits (its code) or the core fails (1): scale requests and generator restarts."""
        from asyncrl.launch.elastic import pop_requests
        from asyncrl.protocol.keys import log_event

        code = None
        while code is None:
            time.sleep(1.0)
            code = self.ray.get(learners[0].poll.remote())
            if self.ray.get(core.poll.remote()) not in (None, 0):
                log.error("the core (Redis + buffer) failed: stopping")
                return 1
            for delta in pop_requests(client, keys):
                self._scale(delta, client, keys, log_event)
            self._supervise_generators(client, keys, log_event)
        return code

    def _teardown(self, core, learners: list) -> None:
        # The learner set the stop key: the generators and the buffer leave by themselves. Redis (the
        # core) must outlive every role's last call: the core keeps it up after the buffer left
        # (asyncrl/launch/deploy_core.py, --wait-for-driver) until it is stopped here, once the learner nodes and
        # the generators are gone. The driver itself calls Redis no more from here on.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
                self._poll(a) is None for a in [*learners, *(a for a, _ in self.generators.values())]):
            time.sleep(1.0)
        try:
            self.ray.get(core.terminate.remote(), timeout=30)
        except Exception as e:  # already gone is fine: we are tearing down
            log.info("teardown: %r", e)
        deadline = time.monotonic() + 45  # the core's buffer grace (30 s) and Redis' shutdown
        while time.monotonic() < deadline and self._poll(core) is None:
            time.sleep(0.5)
        for actor in [core, *learners, *(a for a, _ in self.generators.values())]:
            try:
                self.ray.get(actor.kill.remote(), timeout=30)
            except Exception as e:  # already gone is fine: we are tearing down
                log.info("teardown: %r", e)
            self.ray.kill(actor, no_restart=True)

    def _start_learner(self, pg) -> list:
        cfg = self.cfg
        head = "127.0.0.1" if self.learner_nodes == 1 else self._bundle_ip(pg, 0)
        from asyncrl.launch.redis_server import free_port

        port = free_port()
        actors = []
        for node in range(self.learner_nodes):
            argv = learner_argv(cfg, self.learner_nodes, head, port, self.config_path, self.redis_url)
            argv += node_bind_overrides(cfg, self._bundle_ip(pg, node))
            # Ray restarts actors; a learner rank restarted alone cannot rejoin torchrun's group.
            actors.append(self._actor(f"learner-{node}", argv, pg, node))
        return actors

    def _poll(self, actor):
        try:
            return self.ray.get(actor.poll.remote(), timeout=30)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return "dead"

    def _supervise_generators(self, client, keys, log_event) -> None:
        for gid, (actor, pg) in list(self.generators.items()):
            code = self._poll(actor)
            if code is None:
                continue
            if gid in self.draining and code != "dead":
                print(f"asyncrl ray driver: {gid} drained (exit {code})", flush=True)
                self.ray.kill(actor, no_restart=True)
                self.ray.util.remove_placement_group(pg)
                del self.generators[gid]
                continue
            if code == "dead":
                continue  # the actor is being restarted by Ray; its __init__ re-spawns the generator
            if code == 0:
                continue  # a generator leaves with 0 only when the run stops
            self.num_restarts += 1
            print(f"asyncrl ray driver: generator {gid} exited with {code}: restarting it", flush=True)
            log_event(client, keys, "restart", id=gid, backend="ray", code=code)
            self.ray.get(actor.spawn.remote(fresh_id=True))

    def _scale(self, delta: int, client, keys, log_event) -> None:
        if delta > 0:
            for _ in range(delta):
                try:
                    gid = self.start_generator()
                except PlacementTimeout as e:  # the run goes on with the fleet it has
                    log_event(client, keys, "scale_refused", backend="ray", reason=str(e)[:200])
                    print(f"asyncrl ray driver: scale: not added: {e}", flush=True)
                    return
                log_event(client, keys, "scale_up", id=gid, backend="ray")
                print(f"asyncrl ray driver: scale: added {gid}", flush=True)
            return
        live = [g for g in self.generators if g not in self.draining]
        for gid in live[::-1][:-delta]:
            self.draining.add(gid)
            self.ray.get(self.generators[gid][0].terminate.remote())
            log_event(client, keys, "scale_down", id=gid, backend="ray")
            print(f"asyncrl ray driver: scale: draining {gid}", flush=True)


def driver_main(argv: list[str] | None = None) -> int:
    import argparse

    import ray

    p = argparse.ArgumentParser(prog="python -m asyncrl.launch.deploy_ray driver")
    p.add_argument("config")
    p.add_argument("--cwd", default="", help="the roles' working directory (default: the driver's)")
    p.add_argument("--generators", type=int, default=1)
    p.add_argument("--cpus-per-role", type=float, default=1.0)
    p.add_argument("--gpus-per-node", type=int, default=0)
    p.add_argument("--learner-nodes", type=int, default=1)
    for role in ROLES:
        p.add_argument(f"--{role}-resources", default="")
    args = p.parse_args(argv)
    if args.cwd:  # the driver too: the run folder and every relative path of the config are read from there
        os.chdir(args.cwd)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ray.init(address="auto", namespace=NAMESPACE, log_to_driver=True)
    driver = RayDriver(args.config, args.generators, args.cpus_per_role, args.gpus_per_node, args.learner_nodes,
                       {role: parse_resources(getattr(args, f"{role}_resources")) for role in ROLES})
    from asyncrl.protocol.security import set_redis_password_file

    set_redis_password_file(driver.cfg.deploy.redis_password_file)
    try:
        return driver.run()
    except PlacementTimeout as e:  # the roles placed so far are the job's actors: they go with the driver
        print(f"asyncrl ray driver: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__" and sys.argv[1:2] == ["reap"]:  # start_reaper's process
    _reap(int(sys.argv[2]), sys.argv[3])
elif __name__ == "__main__" and sys.argv[1:2] == ["driver"]:  # the Ray job's entry point (submit_ray)
    sys.exit(driver_main(sys.argv[2:]))
