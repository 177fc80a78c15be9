"""How much staleness is safe: SmolLM2-135M-Instruct on arithmetic with the lag forced to k versions.

Every arm is `configs/smollm2_arith.yaml` with `weights.sync_every=k` and `algorithm.max_staleness=k`
(generators get new weights every k learner steps, so samples are up to k versions old) and one
policy loss: `decoupled_ppo` (PPO-clip around the recomputed proximal policy times a truncated
importance weight against the behaviour log-probs) or `ppo` (PPO-clip with the behaviour policy as the
old policy: no decoupling). `run` starts every arm at once on one GPU, so that all get the same wall
time on the same machine, and stops them together after `--budget-s`; `report` writes a results
JSON (each arm's accuracy against wall time and against trained samples, its lag histogram, its
importance-weight and clipping statistics) and a PNG with both curves.

    python benchmarks/staleness_study.py run --budget-s 420 --out runs/staleness
    python benchmarks/staleness_study.py report runs/staleness \\
        --json benchmarks/results/staleness_smollm2_h100.json --png docs/img/staleness_smollm2_h100.png

Each arm's vLLM engine has a fixed KV cache (`generator.kv_cache_memory_gb`: engines starting side by
side would mislead each other's memory profile) and each learner smaller micro-batches, so that six
runs fit one 80 GB GPU; evaluation every 8 steps lines up with every arm's pushes.
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
from collections import Counter
from pathlib import Path

from smollm2_curve import THRESHOLDS, _jsonl, curve

SHARED = ["eval.every=8", "checkpoint.every=0", "checkpoint.export_hf=false", "generator.gpu_memory_utilization=0.05",
          "generator.kv_cache_memory_gb=2", "learner.micro_batch_tokens=4096", "logging.prometheus=false"]


def arm_name(loss: str, k: int) -> str:
    return f"{loss}_k{k}"


def cmd_run(args) -> int:
    if args.model:  # empty: the config's own model (the tiny default makes its own)
        convert = [sys.executable, "-m", "asyncrl", "model", "smollm2", "--out", args.model, "--dtype", "float32"]
        subprocess.run(convert + (["--gguf", args.gguf] if args.gguf else []), check=True)
    runs, out = Path(args.runs), Path(args.out)
    procs = {}
    for loss in args.losses.split(","):
        for k in (int(x) for x in args.lags.split(",")):
            name = arm_name(loss, k)
            shutil.rmtree(runs / name, ignore_errors=True)
            (out / name).mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            if args.cache_from:  # vLLM's compile cache of an earlier run of the same shapes: no cold compile each
                env["VLLM_CACHE_ROOT"] = f"/tmp/vllm-cache-{name}"
                shutil.rmtree(env["VLLM_CACHE_ROOT"], ignore_errors=True)
                shutil.copytree(args.cache_from, env["VLLM_CACHE_ROOT"])
            overrides = [f"weights.sync_every={k}", f"algorithm.max_staleness={k}", f"algorithm.loss={loss}",
                         *SHARED, *args.overrides]
            cmd = [sys.executable, "-m", "asyncrl", "run", args.config, f"run.name={name}", f"run.dir={runs}",
                   *([f"model.path={args.model}"] if args.model else []), *overrides]
            log = open(out / name / "run.log", "w")  # noqa: SIM115 - open for the run's life
            procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), time.time(),
                           overrides, log)
            time.sleep(args.stagger_s)
    stopped = set()
    while len(stopped) < len(procs):  # each arm stops --budget-s after its own launch
        for name, (p, t_launch, *_) in procs.items():
            if name not in stopped and (p.poll() is not None or time.time() > t_launch + args.budget_s):
                if p.poll() is None:
                    p.send_signal(signal.SIGINT)  # the launcher's Ctrl-C: every role stops within seconds
                stopped.add(name)
        time.sleep(0.5)
    for name, (p, t_launch, overrides, log) in procs.items():
        try:
            rc = p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        log.close()
        for f in ("metrics.jsonl", "eval.jsonl"):
            if (runs / name / f).exists():
                shutil.copy(runs / name / f, out / name / f)
        meta = {"mode": "async", "config": args.config, "overrides": overrides, "budget_s": args.budget_s,
                "t_launch": t_launch, "wall_s": time.time() - t_launch, "rc": rc}
        (out / name / "launch.json").write_text(json.dumps(meta, indent=1))
        print(f"{name}: rc={rc}", flush=True)
    return 0


def arm_stats(run: Path, samples_per_step: int) -> dict:
    c = curve(run)
    steps = [r for r in _jsonl(run / "metrics.jsonl") if "step" in r]
    hist = Counter()
    for r in steps:
        hist.update({int(k): v for k, v in (r.get("lag_hist") or {}).items()})
    total = sum(hist.values()) or 1

    def med(key):
        vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return round(statistics.median(vals), 4) if vals else None

    def mean(key):
        vals = [r[key] for r in steps if isinstance(r.get(key), (int, float))]
        return round(statistics.fmean(vals), 4) if vals else None

    for p in c["curve"]:
        p["samples"] = p["version"] * samples_per_step
    return {**c, "lag_hist_tokens": {str(k): round(v / total, 4) for k, v in sorted(hist.items())},
            "lag_mean": mean("lag_mean"), "lag_max": max((r.get("lag_max", 0) for r in steps), default=None),
            "dropped_stale": steps[-1].get("dropped_stale") if steps else None,
            "is_weight_mean": mean("is_weight_mean"), "is_weight_max": max((r.get("is_weight_max", 0) for r in steps),
                                                                          default=None),
            "is_capped_frac": mean("is_capped_frac"), "masked_frac": mean("masked_frac"),
            "clip_frac": mean("clip_frac"), "ratio_mean": mean("ratio_mean"), "ess": med("ess"),
            "samples_trained": (steps[-1]["step"] if steps else 0) * samples_per_step}


def cmd_report(args) -> int:
    root = Path(args.out)
    arms = {}
    for run in sorted(p for p in root.iterdir() if (p / "launch.json").exists()):
        arms[run.name] = arm_stats(run, args.samples_per_step)
    result = {"benchmark": "staleness_smollm2_arith", "device": args.device, "model": "SmolLM2-135M-Instruct",
              "arms_started_together": True, "shared_overrides": SHARED, "arms": arms}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'arm':18} {'steps':>5} {'best':>6} {'last':>6} {'lag':>5} {'IS mean':>8} {'capped':>7} {'clip':>6}  "
          + "  ".join(f"t({th:.1f})" for th in THRESHOLDS))
    for name, a in arms.items():
        t = [a["time_to_pass@1_s"][f"{th:.1f}"] for th in THRESHOLDS]
        print(f"{name:18} {a['steps']:>5} {a['best_pass@1'] or 0:>6.3f} {a['final_pass@1'] or 0:>6.3f} "
              f"{a['lag_mean'] or 0:>5.2f} {a['is_weight_mean'] or 0:>8.3f} {a['is_capped_frac'] or 0:>7.4f} "
              f"{a['clip_frac'] or 0:>6.3f}  " + "  ".join(f"{'-' if x is None else f'{x:.0f}':>6}" for x in t))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        colours = {}
        for name, a in arms.items():  # one colour per lag, solid for decoupled PPO, dashed for the others
            lag = name.rsplit("_k", 1)[-1]
            style = dict(color=colours.setdefault(lag, f"C{len(colours)}"),
                         linestyle="-" if name.startswith("decoupled") else "--", label=name)
            ax_t.plot([p["t_s"] / 60 for p in a["curve"]], [p["pass@1"] for p in a["curve"]], **style)
            ax_s.plot([p["samples"] / 1000 for p in a["curve"]], [p["pass@1"] for p in a["curve"]], **style)
        ax_t.set_xlabel("minutes from launch")
        ax_s.set_xlabel("thousand samples trained")
        ax_t.set_ylabel("held-out greedy accuracy")
        for ax in (ax_t, ax_s):
            ax.grid(alpha=0.3)
        ax_s.legend(fontsize=8)
        fig.suptitle(f"SmolLM2-135M-Instruct, arithmetic, lag forced to k versions ({args.device})")
        fig.tight_layout()
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="every arm at once on one GPU, for the same wall time")
    r.add_argument("--budget-s", type=float, default=420.0)
    r.add_argument("--lags", default="1,4,8")
    r.add_argument("--losses", default="decoupled_ppo,ppo")
    r.add_argument("--config", default="configs/smollm2_arith.yaml")
    r.add_argument("--model", default="models/smollm2-135m-instruct", help="made from the GGUF; '': the config's own")
    r.add_argument("--gguf", default="", help="a copy of the GGUF file instead of the installed package's")
    r.add_argument("--runs", default="runs")
    r.add_argument("--cache-from", default="", help="a VLLM_CACHE_ROOT to copy for each arm (a warm compile cache)")
    r.add_argument("--stagger-s", type=float, default=3.0, help="seconds between two arms' launches")
    r.add_argument("--out", required=True)
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)
    p = sub.add_parser("report", help="results JSON and PNG from the arms written by `run`")
    p.add_argument("out")
    p.add_argument("--samples-per-step", type=int, default=256, help="learner.batch_groups x generator.n")
    p.add_argument("--json", default="")
    p.add_argument("--png", default="")
    p.add_argument("--device", default="H100")
    p.set_defaults(fn=cmd_report)
    args = parser.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
