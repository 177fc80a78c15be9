"""`algorithm.max_staleness: auto` on the pipeline simulator: fixed bounds against the controller.

For uniform and long-tailed (lognormal) completion lengths and 1-8 generators, every fixed bound of
FIXED and the closed loop (asyncrl/control.py, the code the learner runs) are simulated; the table
gives each arm's throughput over the last third of the steps (after the controller has settled),
the auto arm's ratio to the best fixed arm, its bound's path, its direction changes and the fleet
advice. A guard case gives the batches a synthetic ESS that falls with the lag, which pulls the
bound back. Writes the rows to --json.

    python benchmarks/autotune_sim.py --json benchmarks/results/autotune_sim.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.tools.simulate import SimConfig, SimResult, simulate  # noqa: E402

FIXED = (1, 2, 3, 4, 6, 8)
SETTLED = 2 / 3  # throughput is measured over the steps after this share of the run


def base_config(num_generators: int, len_sigma: float, steps: int) -> SimConfig:
    """A learner three times as fast as one engine's generation, per generator: generation-bound, so
    the bound in flight decides the throughput; lengths of mean 300 tokens, capped at 4096."""
    return SimConfig(num_generators=num_generators, gen_tokens_per_s=2000, seq_tokens_per_s=40,
                     max_concurrent_groups=32, n=8, len_mean=300, len_sigma=len_sigma, max_tokens=4096,
                     batch_groups=16, learner_tokens_per_s=3000 * num_generators, learner_overhead_s=0.2,
                     sync_s=0.5, gen_pause_s=0.2, steps=steps, seed=0)


def settled_tokens_per_s(r: SimResult) -> float:
    k = int(len(r.step_times) * SETTLED)
    return sum(r.step_tokens[k + 1:]) / max(r.step_times[-1] - r.step_times[k], 1e-9)


def compare(base: SimConfig, fixed=FIXED) -> dict:
    """Every fixed bound and the auto arm on one configuration."""
    arms = {k: simulate(replace(base, max_staleness=k)) for k in fixed}
    tps = {k: settled_tokens_per_s(r) for k, r in arms.items()}
    best = max(tps, key=lambda k: (round(tps[k], 6), -k))
    auto = simulate(replace(base, autotune=1, auto_min=min(fixed), auto_max=max(fixed)))
    auto_tps = settled_tokens_per_s(auto)
    moves = [i for i in range(1, len(auto.bounds)) if auto.bounds[i] != auto.bounds[i - 1]]
    return {"generators": base.num_generators, "len_sigma": base.len_sigma, "ess_drift": base.ess_drift,
            "fixed_tokens_per_s": {str(k): v for k, v in tps.items()}, "best_fixed": best,
            "auto_tokens_per_s": auto_tps, "auto_vs_best": auto_tps / tps[best],
            "auto_final_bound": auto.bounds[-1], "auto_bound_path": auto.bounds,
            "auto_settled_step": moves[-1] + 1 if moves else 0, "auto_changes": auto.changes,
            "auto_direction_changes": auto.direction_changes, "auto_lag_mean": auto.lag_mean,
            "auto_learner_idle": auto.learner_idle_ratio, "fleet_advice": auto.fleet_advice[-1],
            "config": asdict(base)}


def run(generators=(1, 2, 4, 8), sigmas=(0.0, 1.0), steps: int = 300, guard: bool = True) -> list[dict]:
    rows = [compare(base_config(g, s, steps)) for s in sigmas for g in generators]
    if guard:  # the off-policy guard: a synthetic ESS exp(-0.1 * lag) falls below 0.8 past a mean lag of 2.2
        rows.append(compare(replace(base_config(max(generators), max(sigmas), steps), ess_drift=0.1)))
    return rows


def table(rows: list[dict]) -> str:
    head = " | ".join(f"fixed {k}" for k in FIXED)
    lines = [f"| lengths | generators | {head} | auto | auto / best | final bound | settled at step | "
             "direction changes | advice |", "|---|---:|" + "---:|" * (len(FIXED) + 6)]
    for r in rows:
        lengths = "uniform" if r["len_sigma"] == 0 else f"lognormal {r['len_sigma']:g}"
        if r["ess_drift"]:
            lengths += f", ESS drift {r['ess_drift']:g}"
        cells = " | ".join(f"{r['fixed_tokens_per_s'][str(k)]:.0f}" + ("*" if k == r["best_fixed"] else "")
                           for k in FIXED)
        lines.append(f"| {lengths} | {r['generators']} | {cells} | {r['auto_tokens_per_s']:.0f} | "
                     f"{r['auto_vs_best']:.2f} | {r['auto_final_bound']} | {r['auto_settled_step']} | "
                     f"{r['auto_direction_changes']} | {r['fleet_advice']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--generators", default="1,2,4,8")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    t0 = time.perf_counter()
    rows = run(tuple(int(x) for x in args.generators.split(",")), steps=args.steps)
    print(table(rows))
    print(f"({time.perf_counter() - t0:.1f}s; trained tokens/s over the last third of {args.steps} steps; "
          "* the best fixed bound)")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python benchmarks/autotune_sim.py " + " ".join(sys.argv[1:]),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
