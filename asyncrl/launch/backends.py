"""Deployment backends by name: where a run's roles run, how `asyncrl submit NAME` starts it there, and
how `asyncrl scale` resizes its generator fleet.

`BACKENDS` is the one table: `asyncrl submit` offers every backend that can be submitted, and
`asyncrl scale` looks up the backend the run published in its Redis (`deploy` hash, written at start:
asyncrl/launch/elastic.py `publish_backend`). A new backend is a `Backend` here, its implementation
in a module of its own. Only argparse at import time (`asyncrl --help` stays instant); each method
imports what it needs.
"""

from __future__ import annotations

import argparse
import sys


class Backend:
    """One deployment backend. The defaults: not submitted by `asyncrl submit`, and scaled through the
    run's `scale` list, which the process that runs the fleet watches (a launcher, a driver)."""

    name = ""
    help = ""  # the `asyncrl submit NAME` line; empty: not submitted (the run starts otherwise)

    def add_submit_args(self, parser: argparse.ArgumentParser) -> None:
        """The options of `asyncrl submit NAME` beyond the config and its overrides."""

    def submit(self, cfg, args: argparse.Namespace) -> int:
        """Starts the run on this backend; the command's exit code."""
        raise NotImplementedError(f"backend {self.name} is not submitted with `asyncrl submit`")

    def scale(self, cfg, client, keys, delta: int) -> str:
        """Adds (delta > 0) or drains away (delta < 0) generators of the running run; what was done."""
        from asyncrl.launch.elastic import request_scale

        request_scale(client, keys, delta)
        return f"asked the {self.name} backend to {'add' if delta > 0 else 'remove'} {abs(delta)} generator(s)"


class LocalBackend(Backend):
    """`asyncrl run`: every role a child of the launcher on this machine (asyncrl/launch/launcher.py)."""

    name = "local"


class SlurmBackend(Backend):
    """sbatch jobs: the core (Redis + buffer), the learner (srun torchrun), one per generator
    (asyncrl/launch/deploy_slurm.py). `asyncrl scale` submits or cancels generator jobs itself."""

    name = "slurm"
    help = "sbatch jobs: core (Redis + buffer), learner (srun torchrun), one per generator"

    def add_submit_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--generators", type=int, default=None,
                            help="generator jobs (default generator.num_generators)")
        parser.add_argument("--learner-nodes", type=int, default=1,
                            help="nodes of the learner job (learner.nproc ranks each)")
        parser.add_argument("--gpus-per-node", type=int, default=0, help="0: CPU jobs (no --gpus-per-node)")
        parser.add_argument("--partition", default="", help="Slurm partition of every job (default: the cluster's)")
        parser.add_argument("--dry-run", action="store_true", help="print the rendered scripts, submit nothing")

    def submit(self, cfg, args: argparse.Namespace) -> int:
        from asyncrl.launch.deploy_slurm import SlurmPlan, submit_slurm

        num = cfg.generator.num_generators if args.generators is None else args.generators
        plan = SlurmPlan(num_generators=num, learner_nodes=args.learner_nodes, gpus_per_node=args.gpus_per_node,
                         partition=args.partition or cfg.deploy.slurm_partition)
        try:
            jobs = submit_slurm(cfg, plan, dry_run=args.dry_run)
        except (RuntimeError, FileNotFoundError) as e:
            print(f"asyncrl submit slurm: {e}", file=sys.stderr)
            return 1
        for role, job in jobs.items():
            print(f"{role}\t{job}")
        if jobs:
            print(f"asyncrl submit slurm: {cfg.run.name}: logs in {cfg.run_dir.resolve()}/logs", file=sys.stderr)
        return 0

    def scale(self, cfg, client, keys, delta: int) -> str:
        from asyncrl.launch.deploy_slurm import scale_slurm

        return scale_slurm(cfg, client, keys, delta)


class RayBackend(Backend):
    """A Ray job whose driver places the roles with placement groups and watches the `scale` list
    (asyncrl/launch/deploy_ray.py)."""

    name = "ray"
    help = "a Ray job whose driver places the roles with placement groups"

    def add_submit_args(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--address", required=True, help="the Ray dashboard address, e.g. http://127.0.0.1:8265")
        parser.add_argument("--generators", type=int, default=None,
                            help="generator actors (default generator.num_generators)")
        parser.add_argument("--learner-nodes", type=int, default=1,
                            help="nodes of the learner group (learner.nproc ranks each)")
        parser.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each learner node's bundle (a "
                            "generator then takes tensor_parallel_size); 0: CPU")
        parser.add_argument("--cpus-per-role", type=float, default=1.0, help="CPUs each role's bundle reserves")
        # deploy_ray imports the standard library only at its top: `asyncrl --help` stays instant.
        from asyncrl.launch.deploy_ray import ROLES

        for role in ROLES:
            parser.add_argument(f"--{role}-resources", default="", metavar="JSON",
                                help=f"custom Ray resources each {role} bundle also reserves, e.g. "
                                     f"'{{\"{role}_node\": 1}}': only nodes started with `ray start --resources` "
                                     f"holding them take the {role}")
        parser.add_argument("--no-wait", action="store_true",
                            help="submit and return (default: stream logs until done)")

    def submit(self, cfg, args: argparse.Namespace) -> int:
        from asyncrl.launch.deploy_ray import ROLES, parse_resources, submit_ray

        num = cfg.generator.num_generators if args.generators is None else args.generators
        resources = {}
        for role in ROLES:
            try:
                resources[role] = parse_resources(getattr(args, f"{role}_resources"))
            except ValueError as e:
                print(f"asyncrl submit ray: --{role}-resources: {e}", file=sys.stderr)
                return 2
        return submit_ray(cfg, args.address, num, cpus_per_role=args.cpus_per_role,
                          gpus_per_node=args.gpus_per_node, learner_nodes=args.learner_nodes,
                          wait=not args.no_wait, resources=resources)


BACKENDS: dict[str, Backend] = {b.name: b for b in (LocalBackend(), SlurmBackend(), RayBackend())}


def backend_named(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown deployment backend {name!r}; known: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def submittable() -> dict[str, Backend]:
    """The backends `asyncrl submit NAME` starts a run on."""
    return {name: b for name, b in BACKENDS.items() if b.help}


def scale(cfg, delta: int) -> str:
    """Scales the running run's generator fleet through the backend that runs it; returns what was
    done, for the console."""
    from asyncrl.protocol.keys import Keys, connect
    from asyncrl.protocol.security import resolve_redis_url

    client = connect(resolve_redis_url(cfg), retry_s=30)
    keys = Keys(cfg.run.name)
    backend = (client.hget(keys.deploy, "backend") or b"").decode()
    if not backend:
        raise ValueError(f"run {cfg.run.name!r} is not running (no {keys.deploy} in Redis)")
    return backend_named(backend).scale(cfg, client, keys, delta)
