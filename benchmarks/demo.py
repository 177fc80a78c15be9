"""The default demo (`asyncrl run`, the embedded tiny.yaml), run N times from a fresh run folder each.

Per run: whole wall time of the command, time from launch to the first learner step, the steady
step (median wall time between consecutive steps from step 10 on, and the median of the learner's
own `step_s` there), the fraction of generated groups dropped as too stale (`dropped_frac` of the
last step), the mean reward of the first 4 and the last 6 steps, and the affinity line the launcher
printed. Prints a table and the medians; `--json` writes them.

    flock /tmp/asyncrl-bench.lock .venv/bin/python benchmarks/demo.py --runs 3 --json benchmarks/results/demo_cpu.json

Each run is `asyncrl run run.name=demoN run.dir=DIR [overrides]` with DIR/demoN removed first, so the
tiny model is written as on a fresh clone. Extra arguments are passed as overrides (for instance
`run.affinity=off` for the unpinned figures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEADY_FROM = 10


def asyncrl_command() -> list[str]:
    exe = Path(sys.executable).with_name("asyncrl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "asyncrl"]


def one_run(name: str, run_dir: Path, overrides: list[str]) -> dict:
    shutil.rmtree(run_dir / name, ignore_errors=True)
    cmd = [*asyncrl_command(), "run", f"run.name={name}", f"run.dir={run_dir}", *overrides]
    (run_dir / name).mkdir(parents=True)
    out_path = run_dir / f"{name}.out"
    t0 = time.time()
    with open(out_path, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    wall = time.time() - t0
    text = out_path.read_text()
    if code != 0:
        raise SystemExit(f"{name}: exit {code}; see {out_path}")
    rows = [json.loads(line) for line in (run_dir / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows]
    steady = [b - a for a, b in zip(times[STEADY_FROM - 1:], times[STEADY_FROM:], strict=False)]
    trained = sum(r["num_groups"] for r in rows)
    last = rows[-1]
    return {
        "name": name, "steps": len(rows), "wall_s": wall, "first_step_s": times[0] - t0,
        "steps_s": times[-1] - times[0], "after_last_step_s": t0 + wall - times[-1],
        "steady_step_wall_s": statistics.median(steady),
        "steady_step_s": statistics.median(r["step_s"] for r in rows[STEADY_FROM:]),
        "dropped_stale": last["dropped_stale"], "groups_trained": trained, "dropped_frac": last["dropped_frac"],
        "lag_max": max(r["lag_max"] for r in rows),
        "reward_first4": statistics.fmean(r["reward_mean"] for r in rows[:4]),
        "reward_last6": statistics.fmean(r["reward_mean"] for r in rows[-6:]),
        "affinity": next((line for line in text.splitlines() if line.startswith("affinity: ")), ""),
    }


COLUMNS = [("wall_s", "wall s", ".1f"), ("first_step_s", "1st step s", ".1f"), ("steps_s", "steps s", ".1f"),
           ("after_last_step_s", "teardown s", ".1f"), ("steady_step_wall_s", "steady step s", ".3f"),
           ("steady_step_s", "learner step_s", ".3f"), ("dropped_frac", "dropped", ".3f"),
           ("reward_first4", "reward first 4", ".3f"), ("reward_last6", "reward last 6", ".3f")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--dir", default="/tmp/demo-runs", help="run.dir of the runs")
    p.add_argument("--json", default="", help="write the runs and their medians here")
    p.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = p.parse_args()
    run_dir = Path(args.dir)
    runs = []
    for i in range(1, args.runs + 1):
        runs.append(one_run(f"demo{i}", run_dir, args.overrides))
        r = runs[-1]
        print(f"demo{i}: " + " ".join(f"{key}={r[key]:{fmt}}" for key, _, fmt in COLUMNS), flush=True)
    medians = {key: statistics.median(r[key] for r in runs) for key, _, _ in COLUMNS}
    print("\n| run | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("| --- |" + " --- |" * len(COLUMNS))
    for r in [*runs, {"name": "median", **medians}]:
        print(f"| {r['name']} | " + " | ".join(f"{r[key]:{fmt}}" for key, _, fmt in COLUMNS) + " |")
    print(f"\n{runs[0]['affinity']}; dropped {sum(r['dropped_stale'] for r in runs)} of "
          f"{sum(r['dropped_stale'] + r['groups_trained'] for r in runs)} groups over {len(runs)} runs")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        result = {
            "command": " ".join(["asyncrl", "run", "run.name=demoN", f"run.dir={args.dir}", *args.overrides]),
            "machine": {"cpus_allowed": len(os.sched_getaffinity(0)), "processor": platform.processor(),
                        "python": platform.python_version()},
            "commit": commit.stdout.strip(), "steady_from_step": STEADY_FROM, "medians": medians, "runs": runs,
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
