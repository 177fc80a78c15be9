"""The deployment subcommands of `asyncrl`: `submit BACKEND` (asyncrl/launch/backends.py), `scale`, `keys`.

Only argparse at import time (`asyncrl --help` stays instant); each command imports what it needs.
"""

from __future__ import annotations

import sys


def cmd_scale(args, load) -> int:
    from asyncrl.launch.backends import scale
    from asyncrl.launch.elastic import parse_delta

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
    from asyncrl.launch.backends import BACKENDS, submittable

    p = sub.add_parser("submit", help=f"submit the run to a scheduler ({', '.join(submittable())})")
    schedulers = p.add_subparsers(dest="backend", required=True)
    for name, backend in submittable().items():
        s = schedulers.add_parser(name, help=backend.help)
        add_config_args(s)
        backend.add_submit_args(s)
        s.set_defaults(fn=lambda a, backend=backend: backend.submit(load(a), a))

    p = sub.add_parser("scale", help=f"add or remove generators of a running run ({', '.join(BACKENDS)})")
    add_config_args(p)
    p.add_argument("--generators", required=True, help="+K adds K generators, -K drains K away")
    p.set_defaults(fn=lambda a: cmd_scale(a, load))

    p = sub.add_parser("keys", help="secrets for multi-node runs: CURVE key pairs, a run token")
    p.add_argument("what", choices=["generate", "token"], help="generate: CURVE server/client key pairs; "
                   "token: a random run token file")
    p.add_argument("--out", required=True, help="generate: a folder; token: a file")
    p.add_argument("--clients", type=int, default=1, help="client key pairs to write (generate)")
    p.set_defaults(fn=cmd_keys)
