"""The deployment subcommands of `asyncrl`: `submit slurm|ray`, `scale`, `keys`.

Only argparse at import time (`asyncrl --help` stays instant); each command imports what it needs.
"""

from __future__ import annotations

import sys


def cmd_submit_slurm(args, load) -> int:
    cfg = load(args)
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


def cmd_submit_ray(args, load) -> int:
    cfg = load(args)
    from asyncrl.launch.deploy_ray import ROLES, parse_resources, submit_ray

    num = cfg.generator.num_generators if args.generators is None else args.generators
    resources = {}
    for role in ROLES:
        try:
            resources[role] = parse_resources(getattr(args, f"{role}_resources"))
        except ValueError as e:
            print(f"asyncrl submit ray: --{role}-resources: {e}", file=sys.stderr)
            return 2
    return submit_ray(cfg, args.address, num, cpus_per_role=args.cpus_per_role, gpus_per_node=args.gpus_per_node,
                      learner_nodes=args.learner_nodes, wait=not args.no_wait, resources=resources)


def cmd_scale(args, load) -> int:
    from asyncrl.launch.elastic import parse_delta, scale

    try:
        delta = parse_delta(args.generators)
    except ValueError as e:
        print(f"asyncrl scale: {e}", file=sys.stderr)
        return 2
    cfg = load(args)
    try:
        print(scale(cfg, delta))
    except (ValueError, ConnectionError, RuntimeError) as e:
        print(f"asyncrl scale: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_keys(args) -> int:
    from asyncrl.protocol.security import generate_keys, write_secret

    if args.what == "generate":
        for path in generate_keys(args.out, args.clients):
            print(path)
    else:
        import secrets

        print(write_secret(args.out, secrets.token_urlsafe(32)))
    return 0


def add_deploy_commands(sub, add_config_args, load) -> None:
    p = sub.add_parser("submit", help="submit the run to a scheduler (slurm, ray)")
    backends = p.add_subparsers(dest="backend", required=True)
    s = backends.add_parser("slurm", help="sbatch jobs: core (Redis + buffer), learner (srun torchrun), one per generator")
    add_config_args(s)
    s.add_argument("--generators", type=int, default=None, help="generator jobs (default generator.num_generators)")
    s.add_argument("--learner-nodes", type=int, default=1, help="nodes of the learner job (learner.nproc ranks each)")
    s.add_argument("--gpus-per-node", type=int, default=0, help="0: CPU jobs (no --gpus-per-node)")
    s.add_argument("--partition", default="", help="Slurm partition of every job (default: the cluster's)")
    s.add_argument("--dry-run", action="store_true", help="print the rendered scripts, submit nothing")
    s.set_defaults(fn=lambda a: cmd_submit_slurm(a, load))
    r = backends.add_parser("ray", help="a Ray job whose driver places the roles with placement groups")
    add_config_args(r)
    r.add_argument("--address", required=True, help="the Ray dashboard address, e.g. http://127.0.0.1:8265")
    r.add_argument("--generators", type=int, default=None, help="generator actors (default generator.num_generators)")
    r.add_argument("--learner-nodes", type=int, default=1, help="nodes of the learner group (learner.nproc ranks each)")
    r.add_argument("--gpus-per-node", type=int, default=0, help="GPUs of each learner node's bundle (a generator then takes "
                   "tensor_parallel_size); 0: CPU")
    r.add_argument("--cpus-per-role", type=float, default=1.0, help="CPUs each role's bundle reserves")
    from asyncrl.launch.deploy_ray import ROLES  # the standard library only: `asyncrl --help` stays instant

    for role in ROLES:
        r.add_argument(f"--{role}-resources", default="", metavar="JSON",
                       help=f"custom Ray resources each {role} bundle also reserves, e.g. '{{\"{role}_node\": 1}}': "
                            f"only nodes started with `ray start --resources` holding them take the {role}")
    r.add_argument("--no-wait", action="store_true", help="submit and return (default: stream logs until done)")
    r.set_defaults(fn=lambda a: cmd_submit_ray(a, load))

    p = sub.add_parser("scale", help="add or remove generators of a running run (local, slurm or ray)")
    add_config_args(p)
    p.add_argument("--generators", required=True, help="+K adds K generators, -K drains K away")
    p.set_defaults(fn=lambda a: cmd_scale(a, load))

    p = sub.add_parser("keys", help="secrets for multi-node runs: CURVE key pairs, a run token")
    p.add_argument("what", choices=["generate", "token"], help="generate: CURVE server/client key pairs; "
                   "token: a random run token file")
    p.add_argument("--out", required=True, help="generate: a folder; token: a file")
    p.add_argument("--clients", type=int, default=1, help="client key pairs to write (generate)")
    p.set_defaults(fn=cmd_keys)
