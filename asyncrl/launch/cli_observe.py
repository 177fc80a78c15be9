"""The observability subcommands of `asyncrl`: `status`, `plot`, `inspect`, `report`.

Only argparse and the standard library at import time (`asyncrl --help` stays instant); each
command imports what it needs after parsing.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _config_and_redis(args):
    """The run's config and Redis URL: `--redis`, else the config's, else the launcher's copy in the run dir.

    `asyncrl run` starts its own redis-server and writes the resolved config (with that URL) to
    `{run_dir}/config.yaml`, so `asyncrl status CONFIG` finds a launcher's run with no extra flags.
    """
    from asyncrl.config import ConfigError, load_config

    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not os.path.exists(config):
        overrides.insert(0, config)
        config = None
    if args.run:
        overrides.append(f"run.name={args.run}")
    try:
        cfg = load_config(config, overrides)
        url = args.redis or cfg.buffer.redis_url
        launched = cfg.run_dir / "config.yaml"
        if not url and launched.exists():
            url = load_config(launched).buffer.redis_url
    except ConfigError as e:
        print(f"asyncrl: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not url:
        print(f"asyncrl: no Redis for run {cfg.run.name!r}: pass --redis redis://HOST:PORT/0, set "
              f"buffer.redis_url, or point at a launcher's run ({cfg.run_dir}/config.yaml not found)", file=sys.stderr)
        raise SystemExit(2)
    cfg.buffer.redis_url = url
    return cfg, url


def cmd_status(args) -> int:
    cfg, url = _config_and_redis(args)
    from asyncrl.observe.ended import open_run
    from asyncrl.observe.status import main

    with open_run(cfg, url, given=bool(args.redis)) as run:
        if run.ended:  # one snapshot: nothing moves any more
            print(f"asyncrl status: {run.note}", file=sys.stderr)
        return main(cfg, run.url, once=args.once or run.ended, as_json=args.json, interval_s=args.interval,
                    last_n=args.last, ended=run.ended)


def cmd_plot(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from asyncrl.observe.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out, x=args.x)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl plot: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    return 0


def cmd_report(args) -> int:
    from asyncrl.observe.report import ReportError, write_report

    try:
        page, png = write_report(args.run_dir, args.out, args.questions)
    except ReportError as e:
        print(f"asyncrl report: {e}", file=sys.stderr)
        return 2
    print(page)
    print(png)
    return 0


def cmd_inspect(args) -> int:
    cfg, url = _config_and_redis(args)
    from asyncrl.observe.ended import newest_weights, open_run
    from asyncrl.observe.inspection import inspect_trajectories, print_records

    path, what = (args.model, "--model") if args.model else newest_weights(cfg)
    with open_run(cfg, url, given=bool(args.redis)) as run:
        if run.ended:
            print(f"asyncrl inspect: {run.note}", file=sys.stderr)
        records = inspect_trajectories(cfg, run.url, args.num, args.samples, path, with_current=not args.no_current)
    print_records(records, path, args.json, what)
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="YAML config of the run (or its {run_dir}/config.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.name=tiny")
    p.add_argument("--redis", default="", help="Redis URL (default: the config's, or the launcher's run dir)")
    p.add_argument("--run", default="", help="run name (default: the config's run.name)")


def add_observe_commands(sub) -> None:
    p = sub.add_parser("status", help="live view of the fleet: generators, learner, buffer, lag, events, stalls "
                       "(a finished run: one snapshot from its run folder)")
    _add_run_args(p)
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="with --once: a machine-readable JSON snapshot")
    p.add_argument("--interval", type=float, default=1.0, help="refresh seconds")
    p.add_argument("--last", type=int, default=20, help="batches in the lag histogram")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("plot", help="PNGs of reward, KL/entropy, version lag, throughput, sync time of a run")
    p.add_argument("run_dir", help="the run directory ({run.dir}/{run.name}) holding metrics.jsonl")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    p.add_argument("--x", choices=("step", "time"), default="step",
                   help="x axis: learner step, or wall-clock minutes since the learner started")
    p.set_defaults(fn=cmd_plot)

    p = sub.add_parser("report", help="one page of a run (live or ended): held-out accuracy against time, "
                       "training numbers, held-out answers before and after training")
    p.add_argument("run_dir", help="the run directory ({run.dir}/{run.name})")
    p.add_argument("--out", default=None, help="the page: FILE.md (Markdown) or FILE.html; the accuracy PNG is "
                   "written beside it (default: RUN_DIR/report.md)")
    p.add_argument("--questions", type=int, default=5, help="held-out questions to show before and after "
                   "(of the eval.show the run kept; 0: none)")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("inspect", help="the newest trajectories: text, reward, versions, behaviour vs current log-probs")
    _add_run_args(p)
    p.add_argument("-n", "--num", type=int, default=2, help="newest groups to show")
    p.add_argument("--samples", type=int, default=2, help="samples per group")
    p.add_argument("--model", default="", help="weights for the current log-probs (default: the learner's "
                   "export {run_dir}/hf-final when the run wrote one, else model.path)")
    p.add_argument("--no-current", action="store_true", help="skip the model forward (no current log-probs)")
    p.add_argument("--json", action="store_true", help="JSON instead of tables")
    p.set_defaults(fn=cmd_inspect)
