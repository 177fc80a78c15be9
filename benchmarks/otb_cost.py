"""What the optimal token baseline costs: the learner's no-grad pass with sum_v pi_v^2 against the plain
proximal log-prob pass, on CPU, at SmolLM2-135M's shape and vocabulary.

    python benchmarks/otb_cost.py --json benchmarks/results/otb_cost_cpu.json

  logprobs_N          learners/step.py: log-probs of every completion token (chunked head)
  logprobs_sum_pi2_N  learners/step.py: log-probs and sum_v pi_v^2 in one pass
                      (algorithm.advantage=optimal_token_baseline)
  advantage           asyncrl.algorithms.advantages.estimate on the step: grpo vs optimal_token_baseline

A Llama model of random weights in float32 (the cost does not depend on the weights' values) and one
ragged step of --groups x --n samples (prompt and completion lengths uniform in their ranges, token
ids over the whole vocabulary) built as the learner builds it: schema.TrajectoryGroup ->
learners.batch.build_step -> learners.packing.plan_step, micro-batches of the learner's CPU budget.
The two passes run under torch.no_grad on the same step, alternating, --repeats times each after one
warm-up; median and min are reported. Peak memory: each pass once more in a fresh process, the
resident-set high-water mark over the pass (Linux /proc/self/clear_refs) minus the resident set
before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PASSES = ("logprobs_N", "logprobs_sum_pi2_N")
ADVANTAGES = ("grpo", "optimal_token_baseline")
ADV_CALLS = 20  # advantage calls a timed repeat (one call is well under a millisecond)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="samples a group")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--comp-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--micro-batch-tokens", type=int, default=0,
                    help="token budget of a micro-batch; 0: the learner's default on this device")
    ap.add_argument("--no-packing", action="store_true", help="padded micro-batches (learner.packing=false)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true", help="skip the fresh-process peak-memory runs")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--memory-of", choices=PASSES, help=argparse.SUPPRESS)  # the child of a memory run
    args = ap.parse_args(argv)
    if args.n < 2:
        ap.error(f"--n must be at least 2 for group advantages, got {args.n}")
    for name in ("prompt_len", "comp_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            ap.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    return args


def build_model(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=args.intermediate, tie_word_embeddings=True, max_position_embeddings=8192,
                      use_cache=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()


def build_groups(args) -> list:
    from asyncrl.protocol import schema

    rng = random.Random(args.seed)
    groups = []
    for g in range(args.groups):
        samples = []
        for _ in range(args.n):
            k = rng.randint(*args.comp_len)
            samples.append(schema.Sample(
                completion_ids=schema.pack_i32([rng.randrange(args.vocab) for _ in range(k)]),
                logprobs=schema.pack_f32([-rng.uniform(0.1, 8.0) for _ in range(k)]),
                versions=schema.pack_i32([0] * k), reward=float(rng.random() > 0.5)))
        groups.append(schema.TrajectoryGroup(
            schema_version=schema.SCHEMA_VERSION, group_id=f"p{g}@e0", prompt_id=f"p{g}", generator_id="bench",
            prompt_ids=schema.pack_i32([rng.randrange(args.vocab) for _ in range(rng.randint(*args.prompt_len))]),
            samples=samples, sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=0.0))
    return groups


def setup(args) -> dict:
    """The model, the step, its plan's micro-batches and the learner config, as the learner has them."""
    import torch

    from asyncrl.config import load_config
    from learners import packing
    from learners.batch import build_step
    from learners.step import rank_micro_batches

    device = torch.device("cpu")
    cfg = load_config(None, [f"learner.packing={str(not args.no_packing).lower()}",
                             "algorithm.advantage=optimal_token_baseline"])
    model = build_model(args)
    packing.packed_attention(model, device, torch.float32)
    budget = args.micro_batch_tokens or packing.default_micro_batch_tokens(model.config, device, torch.float32, False)
    step = build_step(build_groups(args), device)
    lc = cfg.learner
    plan = packing.plan_step(step.group_sizes, step.lengths, step.comp_len, world=1, minibatches=lc.minibatches,
                             epochs=lc.ppo_epochs, budget=budget, packed=lc.packing, seed=args.seed)
    return {"cfg": cfg, "model": model, "step": step, "micro": rank_micro_batches(plan, 0), "budget": budget,
            "pad_id": model.config.pad_token_id or 0}


def run_pass(name: str, s: dict):
    import torch

    from learners.step import logprobs_N, logprobs_sum_pi2_N

    fn = {"logprobs_N": logprobs_N, "logprobs_sum_pi2_N": logprobs_sum_pi2_N}[name]
    with torch.no_grad():
        return fn(s["model"], s["step"], s["micro"], s["cfg"], s["pad_id"])


def time_passes(s: dict, repeats: int) -> tuple[dict, tuple]:
    """Seconds of each pass, alternating the order every repeat so that a drift in the machine's load
    does not always favour one; and the warm-up's (log-probs, (log-probs, sum pi^2))."""
    plain = run_pass("logprobs_N", s)  # warm-ups
    both = run_pass("logprobs_sum_pi2_N", s)
    times = {name: [] for name in PASSES}
    for r in range(repeats):
        for name in (PASSES if r % 2 == 0 else PASSES[::-1]):
            t0 = time.perf_counter()
            run_pass(name, s)
            times[name].append(time.perf_counter() - t0)
        print(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]:.3g} s" for k, v in times.items()), flush=True)
    return times, (plain, both)


def time_advantages(s: dict, logp_N, pi2_N, repeats: int) -> dict:
    """Seconds of one `asyncrl.algorithms.advantages.estimate` call on the step, per estimator."""
    import torch

    from asyncrl.algorithms.advantages import AdvantageInputs, estimate
    from asyncrl.config import load_config

    step = s["step"]
    mask = step.grid(torch.ones(step.num_tokens))
    scores = step.rewards_S.float().view(-1, step.group_size)
    inputs = {}
    for adv in ADVANTAGES:
        alg = load_config(None, [f"algorithm.advantage={adv}"]).algorithm
        extra = {"logp_BT": step.grid(logp_N), "sum_pi2_BT": step.grid(pi2_N)} if adv == "optimal_token_baseline" else {}
        inputs[adv] = AdvantageInputs(scores, mask, alg, **extra)
    times = {adv: [] for adv in ADVANTAGES}
    for r in range(repeats + 1):
        for adv in (ADVANTAGES if r % 2 == 0 else ADVANTAGES[::-1]):
            t0 = time.perf_counter()
            for _ in range(ADV_CALLS):
                estimate(inputs[adv])
            if r:  # the first round is a warm-up
                times[adv].append((time.perf_counter() - t0) / ADV_CALLS)
    return times


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(args) -> None:
    """One pass in this fresh process; prints the resident-set growth at its peak, in MiB."""
    s = setup(args)
    Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark to the current resident set
    before = _status_kib("VmRSS")
    run_pass(args.memory_of, s)
    print(json.dumps({"pass": args.memory_of, "peak_mib": (_status_kib("VmHWM") - before) / 1024,
                      "rss_before_mib": before / 1024}))


def peak_memory(argv: list[str], name: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv, "--memory-of", name, "--no-memory"], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summary(ts: list[float]) -> dict:
    return {"median_s": statistics.median(ts), "min_s": min(ts), "all_s": ts}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.memory_of:
        memory_child(args)
        return
    import torch
    import transformers

    t0 = time.perf_counter()
    s = setup(args)
    step, micro = s["step"], s["micro"]
    shape = {"vocab": args.vocab, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
             "kv_heads": args.kv_heads, "intermediate": args.intermediate, "tied_embeddings": True, "dtype": "float32",
             "params": sum(p.numel() for p in s["model"].parameters())}
    batch = {"groups": args.groups, "n": args.n, "prompt_len": args.prompt_len, "comp_len": args.comp_len,
             "sequences": len(step.lengths), "tokens": sum(step.lengths), "completion_tokens": step.num_tokens,
             "micro_batches": len(micro), "micro_batch_tokens": s["budget"], "packing": not args.no_packing}
    print(json.dumps({"shape": shape, "batch": batch, "setup_s": round(time.perf_counter() - t0, 1)}), flush=True)

    pass_times, (plain_N, (logp_N, pi2_N)) = time_passes(s, args.repeats)
    max_diff = (plain_N - logp_N).abs().max().item()
    adv_times = time_advantages(s, logp_N, pi2_N, args.repeats)
    rows = {name: summary(ts) for name, ts in {**pass_times, **{f"advantage {a}": t for a, t in adv_times.items()}}.items()}
    plain = rows["logprobs_N"]["median_s"]
    for row in rows.values():
        row["ratio_to_plain"] = row["median_s"] / plain
    if not args.no_memory:
        del s  # the children need the cores and the memory
        for name in PASSES:
            rows[name].update({k: v for k, v in peak_memory(argv, name).items() if k != "pass"})

    print(f"{'pass':<34} {'median s':>10} {'min s':>10} {'x plain':>8} {'peak MiB':>9}")
    for name, r in rows.items():
        peak = f"{r['peak_mib']:9.0f}" if "peak_mib" in r else f"{'':>9}"
        print(f"{name:<34} {r['median_s']:10.4g} {r['min_s']:10.4g} {r['ratio_to_plain']:8.3g} {peak}")
    print(f"{batch['completion_tokens']} completion tokens of {batch['tokens']} in {batch['micro_batches']} "
          f"micro-batch(es); max |logp difference| between the passes {max_diff:.2e}")
    result = {"benchmark": "otb_cost", "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": platform.machine(), "processor": platform.processor() or "cpu", "cpus": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(),
              "shape": shape, "batch": batch, "repeats": args.repeats, "advantage_calls_a_repeat": ADV_CALLS,
              "seed": args.seed, "max_abs_logp_diff": max_diff, "rows": rows,
              "note": ("The passes ran alternating, side by side in one run, on a machine whose cores other "
                       "work shared: the ratios are comparable, the absolute seconds depend on the load. "
                       "peak_mib: resident-set growth over one pass in a fresh process.")}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
