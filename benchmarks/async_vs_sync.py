"""Async vs sync, side by side on one machine, plus each stage alone: does the decoupling pay?

    python benchmarks/async_vs_sync.py                        # the tiny copy task on CPU
    python benchmarks/async_vs_sync.py --preset gpu --model /path/to/Qwen2.5-0.5B-Instruct \
        --data data/gsm8k/train.parquet                       # one GPU (needs vLLM's CUDA build)
    python benchmarks/async_vs_sync.py --preset gpu-copy --steps 16 --modes sync-nosleep,sync \
        --no-stages --out runs/gpu-copy                       # one GPU, no weights to download
    python benchmarks/async_vs_sync.py --preset gpu-copy --steps 16 --stage-steps 8 --min-gen-s 10 \
        --modes async --merge runs/gpu-copy/async_vs_sync.json --out runs/gpu-copy

`gpu-copy`: the copy task on one GPU with a random-init model written here, so nothing is downloaded:
the Qwen2.5-0.5B body (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864; 0.36B parameters
without the real vocabulary: the copy task's tokenizer has 128 tokens), warm-started on the GPU for 60
supervised steps at lr 3e-4 on copies of the run's own lengths. Prompts of 128-384 letters (one token
each), completions up to 256 tokens (ragged: a copy ends where its prompt does), 64 groups of 8 a step
(512 sequences). vLLM's CUDA build in bf16 with CUDA graphs (`enforce_eager=false`, 30% of the GPU's
memory); the learner on the same GPU in bf16 mixed precision (fp32 reductions); weights over
`weights.backend=auto`, which picks CUDA IPC when the learner and the engine share a node. Needs,
besides torch, transformers and vLLM's CUDA build: pyzmq, msgspec, redis (redis-py), pyyaml, numpy,
safetensors, tokenizers, psutil (uvloop is used when present), and a `redis-server` binary on PATH.
Without CUDA the preset still runs on vLLM's CPU build when shrunk: `model.tiny.hidden_size=128
model.tiny.num_layers=2 model.tiny.num_heads=2 model.tiny.num_kv_heads=1 model.tiny.intermediate_size=256
learner.batch_groups=4 generator.n=4 generator.enforce_eager=true data.min_len=8 data.max_len=16
generator.max_tokens=16 generator.max_model_len=64` (a start-up check of the preset, not a measurement).

Modes: `async`, `sync`, and `sync-sleep` / `sync-nosleep` (sync with `generator.sleep=on` / `off`;
plain `sync` keeps the default, auto). `--merge` adds the modes of an earlier call's results JSON, so
that runs too long for one call can be split (the results are written after every mode).

Real runs, back to back in one invocation (the machine's load drifts; ratios of neighbours are
what to read):
1. `asyncrl run run.mode=async`, 2. `asyncrl run run.mode=sync`, the same `run.max_steps` (so the
   same number of trained samples), the same model, data and seed;
3. generator alone: redis-server + `asyncrl buffer` + one `asyncrl generator`, no learner, an
   admission bound high enough that nothing holds it back: generated tokens/s;
4. learner alone: `asyncrl learner` on the trajectories run 3 left in Redis (real groups, as
   tests/test_learner_resume.py does with fixed ones): trained tokens/s;
5. runs 3 and 4 again with the async run's final policy (`bench-async/hf-final`): what the stages
   cost changes as the policy learns, so a run's stage rate lies between the two; the efficiency
   uses the mean of the initial- and final-policy rates of each stage.

Throughputs are measured over the steady window (first step to last step), so process start-up
(vLLM, torchrun) is excluded; total wall time including start-up is reported too. Pipeline
efficiency = async trained tokens/s / min(generator alone, learner alone).
Generator idle ratios are read from `gen:*` heartbeats (`idle_s`) polled during the run.

Stages on their own cores: `--preset cpu-pinned` (generator on CPU 0; learner, buffer and Redis on
CPU 1, via `generator.cpus` / `learner.cpus` / `buffer.cpus`; learner.ppo_epochs=6 with 32 groups a
step, so the stages are balanced on the 2-core box and the per-step weight sync is amortised). Every run, the stage-alone ones included, is pinned the same way;
the CPUs each process really ran on are read back during the run and written to the results.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from asyncrl.config import dump_yaml, load_config  # noqa: E402

PRESETS = {
    # Balanced on a 2-core box: one generator limited to 2 groups in flight vs one learner rank.
    "cpu": ["generator.max_concurrent_groups=2", "generator.kv_cache_gb=0.5", "learner.batch_groups=8",
            "algorithm.max_staleness=2", "logging.prometheus=false", "run.stall_timeout_s=0"],
    # Each stage on its own core: the generator's vLLM processes on CPU 0, the learner (and the buffer
    # and Redis, which are light) on CPU 1; 6 PPO epochs make the learner about as fast as the engine.
    "cpu-pinned": ["generator.max_concurrent_groups=2", "generator.kv_cache_gb=0.5", "learner.batch_groups=32",
                   "learner.ppo_epochs=6", "algorithm.max_staleness=2", "logging.prometheus=false",
                   "run.stall_timeout_s=0", "generator.cpus=0", "learner.cpus=1", "buffer.cpus=1"],
    # One GPU, the copy task and a random-init model built here (see the docstring): nothing to download.
    "gpu-copy": ["model.tiny.hidden_size=896", "model.tiny.num_layers=24", "model.tiny.num_heads=14",
                 "model.tiny.num_kv_heads=2", "model.tiny.intermediate_size=4864", "model.tiny.warm_start_steps=60",
                 "model.tiny.warm_start_lr=0.0003", "model.dtype=bfloat16", "generator.dtype=bfloat16",
                 "data.min_len=128", "data.max_len=384", "generator.max_tokens=256", "generator.max_model_len=768",
                 "generator.n=8", "generator.max_concurrent_groups=128", "generator.gpu_memory_utilization=0.3",
                 "generator.enforce_eager=false", "learner.batch_groups=64", "learner.lr=1e-5",
                 "learner.mixed_precision.param_dtype=bfloat16", "learner.mixed_precision.reduce_dtype=float32",
                 "buffer.prompt_backlog=256", "algorithm.max_staleness=2",
                 "logging.prometheus=false", "run.stall_timeout_s=0"],
    # One GPU shared by one vLLM engine and one learner rank (the stages do not get their own device).
    "gpu": ["data.task=gsm8k", "reward.name=gsm8k", "data.chat_template=true", "generator.n=8",
            "generator.max_tokens=512", "generator.max_model_len=1024", "generator.max_concurrent_groups=64",
            "generator.gpu_memory_utilization=0.35", "generator.enforce_eager=false", "model.dtype=bfloat16",
            "learner.batch_groups=32", "learner.lr=1e-6",
            "algorithm.max_staleness=2", "logging.prometheus=false", "run.stall_timeout_s=0"],
}


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class HeartbeatPoller(threading.Thread):
    """Samples every `gen:*` heartbeat twice a second: (time, id, tokens, idle_s, state)."""

    def __init__(self, url_fn, run_name: str):
        super().__init__(daemon=True)
        self.url_fn, self.run_name = url_fn, run_name
        self.samples: list[tuple[float, str, float, float, str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        import redis

        from asyncrl.protocol.keys import Keys

        client, keys = None, Keys(self.run_name)
        while not self.done.is_set():
            try:
                if client is None and (url := self.url_fn()):
                    client = redis.Redis.from_url(url)
                if client is not None:
                    for key in client.scan_iter(keys.gen_pattern, count=100):
                        info = {k.decode(): v.decode() for k, v in client.hgetall(key).items()}
                        if info:
                            self.samples.append((time.time(), info["id"], float(info.get("tokens", 0)),
                                                 float(info.get("idle_s", 0)), info.get("state", "")))
            except redis.RedisError:
                client = None
            time.sleep(0.5)

    def idle_ratio(self, t0: float, t1: float) -> float | None:
        """Generator idle seconds / wall seconds over [t0, t1], averaged over generators."""
        ratios = []
        for gid in {s[1] for s in self.samples}:
            mine = [s for s in self.samples if s[1] == gid and t0 <= s[0] <= t1]
            if len(mine) >= 2 and mine[-1][0] > mine[0][0]:
                ratios.append((mine[-1][3] - mine[0][3]) / (mine[-1][0] - mine[0][0]))
        return statistics.mean(ratios) if ratios else None

    def busy_rate(self, t0: float, t1: float) -> float | None:
        """Generated tokens per non-idle second over [t0, t1] (one generator: the stage-alone run)."""
        mine = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(mine) < 2:
            return None
        busy = (mine[-1][0] - mine[0][0]) - (mine[-1][3] - mine[0][3])
        return (mine[-1][2] - mine[0][2]) / busy if busy > 0 else None


def affinity_snapshot(pids: list[int]) -> list[dict]:
    """Each live process under `pids` (and itself) with the CPUs the kernel lets it run on."""
    import psutil

    from asyncrl.launch.affinity import format_cpus

    out = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
                out.append({"pid": p.pid, "cmd": cmd[:160], "cpus": format_cpus(p.cpu_affinity()),
                            "threads": p.num_threads()})
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
    return out


def snapshot_when(ready, pids_fn, timeout_s: float = 900) -> dict:
    """Starts a thread that takes `affinity_snapshot(pids_fn())` once `ready()` is true (the run is in
    its steady state: every role is up); the dict it fills holds the snapshot under "procs"."""
    box: dict = {}

    def watch():
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if ready():
                time.sleep(1.0)
                box["procs"] = affinity_snapshot(pids_fn())
                return
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    return box


def window_stats(rows: list[dict]) -> dict:
    """Steady-state numbers from a run's metrics rows: the window from the first to the last step."""
    first, last = rows[0], rows[-1]
    span = last["time"] - first["time"]
    tokens = sum(r["tokens"] for r in rows[1:])
    idle = (last["idle_ratio"] * last["elapsed_s"] - first["idle_ratio"] * first["elapsed_s"]) / max(span, 1e-9)
    lags = {}
    for r in rows:
        for k, v in r["lag_hist"].items():
            lags[int(k)] = lags.get(int(k), 0) + v
    num_lag = max(sum(lags.values()), 1)
    return {
        "steps": len(rows), "window_s": span, "trained_tokens_per_s": tokens / max(span, 1e-9),
        "trained_tokens": sum(r["tokens"] for r in rows),
        "step_s_median": statistics.median(r["step_s"] for r in rows),
        "sync_s_median": statistics.median(r["sync_s"] for r in rows),
        "learner_idle_ratio": idle,
        "reward_first4": statistics.mean(r["reward_mean"] for r in rows[:4]),
        "reward_last4": statistics.mean(r["reward_mean"] for r in rows[-4:]),
        "lag_mean": sum(k * v for k, v in lags.items()) / num_lag, "lag_max": max(lags) if lags else 0,
        "lag_hist": {str(k): lags[k] for k in sorted(lags)},
        "dropped_stale": last["dropped_stale"], "window": (first["time"], last["time"]),
    }


MODE_SUFFIXES = {"sleep": ["generator.sleep=on"], "nosleep": ["generator.sleep=off"]}


def mode_overrides(mode: str) -> list[str]:
    """`async`, `sync`, or either with a suffix: `sync-sleep` (generator.sleep=on), `sync-nosleep` (off)."""
    run_mode, _, suffix = mode.partition("-")
    if run_mode not in ("async", "sync") or (suffix and suffix not in MODE_SUFFIXES):
        raise SystemExit(f"unknown mode {mode!r}: async or sync, optionally -{'/-'.join(MODE_SUFFIXES)}")
    return [f"run.mode={run_mode}", *MODE_SUFFIXES.get(suffix, [])]


def sleep_stats(run_dir: Path) -> dict:
    """From the generators' logs: the seconds each wake took before a weight load (generator.sleep),
    and the memory vLLM reported freed by a sleep."""
    import re

    text = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("generator-*.log"))
    wakes = [float(w) for w in re.findall(r"now at version \d+ .*? wake ([0-9.]+)s\)", text)]
    freed = [float(f) for f in re.findall(r"Sleep mode freed ([0-9.]+) GiB", text)]
    slept = [w for w in wakes if w > 0]
    return {"num_wakes": len(slept), "wake_s_median": statistics.median(slept) if slept else 0.0,
            "sleep_freed_gib": statistics.median(freed) if freed else 0.0}


def run_mode(mode: str, base: list[str], out_dir: Path, env: dict) -> dict:
    name = f"bench-{mode}"
    run_dir = out_dir / name
    overrides = [*base, f"run.dir={out_dir}", f"run.name={name}", *mode_overrides(mode)]

    def url():
        path = run_dir / "config.yaml"
        if not path.exists():
            return None
        return load_config(path).buffer.redis_url or None

    poller = HeartbeatPoller(url, name)
    poller.start()
    t0, load0 = time.time(), os.getloadavg()[0]
    with open(out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", *overrides], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO)
        snap = snapshot_when(lambda: len(_rows(run_dir)) >= 2, lambda: [proc.pid])
        rc = proc.wait()
    wall = time.time() - t0
    poller.done.set()
    poller.join()
    if rc != 0:
        raise RuntimeError(f"{mode} run failed (rc={rc}); see {out_dir / f'{name}.log'}")
    rows = _rows(run_dir)
    stats = window_stats(rows)
    stats.update(sleep_stats(run_dir))
    if all("peak_mem_gb" in r for r in rows):
        stats["learner_peak_gib_max"] = max(r["peak_mem_gb"] for r in rows)
        stats["micro_batches_median"] = statistics.median(r["micro_batches"] for r in rows)
    stats.update(mode=mode, wall_s=wall, run_dir=str(run_dir),
                 generator_idle_ratio=poller.idle_ratio(*stats["window"]),
                 load_avg_1m=(load0, os.getloadavg()[0]), processes=snap.get("procs", []))
    return stats


def _wait_left(proc: subprocess.Popen, client, keys, timeout_s: float = 240) -> None:
    """Waits for a SIGTERMed generator to exit. Once it has logged `generator_leave` (drained, every
    group confirmed) a process still alive 30 s later is stuck in engine teardown: it is killed."""
    from asyncrl.launch.launcher import kill_tree

    deadline, left_at = time.time() + timeout_s, None
    while proc.poll() is None and time.time() < deadline:
        if left_at is None and any(f.get(b"kind") == b"generator_leave" for _, f in client.xrange(keys.events)):
            left_at = time.time()
        if left_at is not None and time.time() - left_at > 30:
            print("generator left but its process did not exit within 30 s: killed", flush=True)
            kill_tree(proc.pid, 9)
            break
        time.sleep(0.5)
    proc.wait(timeout=30)


def stages_alone(base: list[str], out_dir: Path, env: dict, steps: int, min_gen_s: float,
                 name: str = "bench-stages") -> dict:
    """Generator alone (no learner consuming), then the learner alone on what it generated."""
    from asyncrl.launch.affinity import cpus_of
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.protocol import schema
    from asyncrl.protocol.keys import Keys, connect

    probe = load_config(None, base)
    redis = LocalRedis(out_dir / "redis-stages", cpus=cpus_of(probe, "buffer")).start()  # as the launcher's
    try:
        cfg = load_config(None, [*base, f"run.dir={out_dir}", f"run.name={name}", f"buffer.redis_url={redis.url}",
                                 "algorithm.max_staleness=100000", f"run.max_steps={steps}"])
        cfg_path = out_dir / f"{name}.yaml"
        cfg_path.write_text(dump_yaml(cfg))
        client, keys = connect(redis.url), Keys(name)
        py = [sys.executable, "-m", "asyncrl"]
        logs = {r: open(out_dir / f"{name}-{r}.log", "w") for r in ("buffer", "generator", "learner")}
        procs = {r: subprocess.Popen([*py, r, str(cfg_path), *(["--id", "g0"] if r == "generator" else [])],
                                     stdout=logs[r], stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                     start_new_session=True) for r in ("buffer", "generator")}
        need = steps * cfg.learner.batch_groups
        poller = HeartbeatPoller(lambda: redis.url, name)
        poller.start()
        gen_snap = snapshot_when(lambda: client.xlen(keys.trajectories) >= 4,
                                 lambda: [redis.proc.pid, procs["buffer"].pid, procs["generator"].pid])
        deadline = time.time() + 900
        while client.xlen(keys.trajectories) < 2 and time.time() < deadline:
            assert procs["generator"].poll() is None, "generator died; see its log"
            time.sleep(0.2)
        t_start = time.time()
        while (client.xlen(keys.trajectories) < need + 1 or time.time() - t_start < min_gen_s) \
                and time.time() < deadline:
            time.sleep(0.2)
        # The generator leaves first (SIGTERM: it drains while the buffer can still confirm its groups),
        # then the buffer (the stop key).
        procs["generator"].terminate()
        _wait_left(procs["generator"], client, keys)
        client.set(keys.stop, "1")
        procs["buffer"].wait(timeout=60)
        groups = [schema.decode(f[b"data"], schema.TrajectoryGroup)
                  for _, f in client.xrange(keys.trajectories)]
        groups.sort(key=lambda g: g.created_at)
        # The first group's creation marks the start; tokens of the groups after it over the span.
        span = groups[-1].created_at - groups[0].created_at
        gen_tps = sum(g.num_tokens() for g in groups[1:]) / max(span, 1e-9)
        poller.done.set()
        poller.join()
        window = (groups[0].created_at, groups[-1].created_at)
        lengths = [s.num_tokens for g in groups for s in g.samples]
        client.delete(keys.stop)
        learner = subprocess.Popen([*py, "learner", str(cfg_path)], stdout=logs["learner"],
                                   stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        learn_snap = snapshot_when(lambda: len(_rows(out_dir / name)) >= 2, lambda: [redis.proc.pid, learner.pid])
        if learner.wait(timeout=900) != 0:
            raise RuntimeError(f"learner-alone run failed; see {out_dir / f'{name}-learner.log'}")
        for f in logs.values():
            f.close()
        learn = window_stats(_rows(out_dir / name))
        return {"generator_tokens_per_s": gen_tps, "generator_groups": len(groups), "generator_window_s": span,
                "generator_idle_ratio": poller.idle_ratio(*window),
                "generator_busy_tokens_per_s": poller.busy_rate(*window),
                "sample_len_mean": statistics.mean(lengths), "sample_len_max": max(lengths),
                "learner_tokens_per_s": learn["trained_tokens_per_s"], "learner_step_s_median": learn["step_s_median"],
                "learner_steps": learn["steps"], "generator_processes": gen_snap.get("procs", []),
                "learner_processes": learn_snap.get("procs", [])}
    finally:
        redis.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--steps", type=int, default=24, help="run.max_steps of every run (same trained samples)")
    ap.add_argument("--model", default="", help="model dir (default: a tiny model written under --out)")
    ap.add_argument("--data", default="", help="gpu preset: the GSM8K train parquet")
    ap.add_argument("--out", default="runs/bench-async-vs-sync")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (CPU)")
    ap.add_argument("--modes", default="async,sync")
    ap.add_argument("--no-stages", action="store_true", help="skip the stage-alone runs")
    ap.add_argument("--min-gen-s", type=float, default=20.0, help="shortest generator-alone window, seconds")
    ap.add_argument("--stage-steps", type=int, default=0,
                    help="learner steps of each stage-alone run (0: --steps); the generator alone makes that many batches")
    ap.add_argument("--merge", default="", help="a results JSON of an earlier call whose modes join this one's")
    ap.add_argument("overrides", nargs="*", help="extra dotted config overrides for every run")
    args = ap.parse_args()
    out_dir = Path(args.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        import torch

        from asyncrl.tools.tiny_model import write_tiny_model

        # The preset's model.tiny_* shape and warm start; on the GPU when there is one (larger shapes).
        probe = load_config(None, [*PRESETS[args.preset], *args.overrides])
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = out_dir / "tiny-model"
        if not (model / "model.safetensors").exists():  # a later call (--merge) reuses the same model
            write_tiny_model(model, seed=0, warm_start_steps=probe.model.tiny.warm_start_steps, device=device,
                             warm_start_lr=probe.model.tiny.warm_start_lr,
                             copy_len=(probe.data.min_len, probe.data.max_len),
                             max_positions=max(512, probe.generator.max_model_len), **probe.tiny_shape())
        model = str(model)
    base = [*PRESETS[args.preset], f"run.max_steps={args.steps}", f"model.path={model}", *args.overrides]
    if args.data:
        base.append(f"data.path={args.data}")
    # The repo first, then what PYTHONPATH already holds (vLLM's CUDA bundle is installed that way on the GPU box).
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": pythonpath}
    results = {"preset": args.preset, "steps": args.steps, "overrides": base, "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "modes": {}}
    if args.merge:
        earlier = json.loads(Path(args.merge).read_text())
        results["modes"].update(earlier["modes"])
        results["merged_from"] = {"date": earlier["date"], "modes": sorted(earlier["modes"])}
    path = out_dir / "async_vs_sync.json"
    for mode in [m for m in args.modes.split(",") if m]:
        mode_overrides(mode)  # an unknown mode fails before any run starts
    for mode in [m for m in args.modes.split(",") if m]:
        results["modes"][mode] = run_mode(mode, base, out_dir, env)
        print(f"{mode}: {results['modes'][mode]['trained_tokens_per_s']:.1f} trained tok/s", flush=True)
        path.write_text(json.dumps(results, indent=2))  # what is done survives a call that runs out of time
    if not args.no_stages:
        stage_steps = args.stage_steps or args.steps
        results["stages"] = stages_alone(base, out_dir, env, stage_steps, min_gen_s=args.min_gen_s)
        final = out_dir / "bench-async" / "hf-final"
        if "async" in results["modes"] and final.exists():
            # The workload drifts as the policy learns (which samples run long, how much a batch pads),
            # so each stage is measured again with the async run's final policy; a run's stage rate
            # lies between the two, and the efficiency uses their mean.
            results["stages_final"] = stages_alone([*base, f"model.path={final}"], out_dir, env, stage_steps,
                                                   min_gen_s=args.min_gen_s, name="bench-stages-final")
    summarize(results)
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return 0


def summarize(results: dict) -> None:
    modes = results["modes"]
    cols = ("mode", "wall s", "window s", "trained tok/s", "reward first4->last4", "lag mean/max", "learner idle",
            "gen idle", "step s", "sync s", "wake s", "freed GiB")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for m, s in modes.items():
        gi = s["generator_idle_ratio"]
        print(f"| {m} | {s['wall_s']:.1f} | {s['window_s']:.1f} | {s['trained_tokens_per_s']:.1f} | "
              f"{s['reward_first4']:.3f} -> {s['reward_last4']:.3f} | {s['lag_mean']:.2f}/{s['lag_max']} | "
              f"{s['learner_idle_ratio']:.2f} | {'n/a' if gi is None else f'{gi:.2f}'} | "
              f"{s['step_s_median']:.3f} | {s['sync_s_median']:.3f} | {s.get('wake_s_median', 0.0):.3f} | "
              f"{s.get('sleep_freed_gib', 0.0):.1f} |")
    derived = {}
    if "async" in modes and "sync" in modes:
        derived["speedup_tokens_per_s"] = modes["async"]["trained_tokens_per_s"] / modes["sync"]["trained_tokens_per_s"]
        derived["speedup_wall"] = modes["sync"]["wall_s"] / modes["async"]["wall_s"]
    for asleep in ("sync", "sync-sleep"):
        if asleep in modes and "sync-nosleep" in modes and modes[asleep].get("num_wakes"):
            derived[f"{asleep}_vs_nosleep_tokens_per_s"] = (modes[asleep]["trained_tokens_per_s"]
                                                            / modes["sync-nosleep"]["trained_tokens_per_s"])
    if (st := results.get("stages")) is not None:
        g, lr = st["generator_tokens_per_s"], st["learner_tokens_per_s"]
        gi, gb = st.get("generator_idle_ratio"), st.get("generator_busy_tokens_per_s")
        print(f"stages alone: generator {g:.1f} tok/s (idle {'n/a' if gi is None else f'{gi:.2f}'}, "
              f"{'n/a' if gb is None else f'{gb:.1f}'} per busy second), learner {lr:.1f} tok/s "
              f"(mean sample length {st['sample_len_mean']:.2f})")
        if (fin := results.get("stages_final")) is not None:
            derived["generator_alone_initial"], derived["learner_alone_initial"] = g, lr
            derived["generator_alone_final"] = fin["generator_tokens_per_s"]
            derived["learner_alone_final"] = fin["learner_tokens_per_s"]
            print(f"stages alone, async run's final policy: generator {fin['generator_tokens_per_s']:.1f} tok/s, "
                  f"learner {fin['learner_tokens_per_s']:.1f} tok/s")
            g, lr = (g + fin["generator_tokens_per_s"]) / 2, (lr + fin["learner_tokens_per_s"]) / 2
            derived["generator_alone"], derived["learner_alone"] = g, lr
        derived["bottleneck_tokens_per_s"] = min(g, lr)
        # Serial (sync) vs overlapped (async) with these stage rates: 1/(1/g + 1/l) vs min(g, l).
        derived["ideal_speedup"] = min(g, lr) * (1 / g + 1 / lr)
        for m in modes:
            derived[f"efficiency_{m}"] = modes[m]["trained_tokens_per_s"] / min(g, lr)
    results["derived"] = derived
    print(" ".join(f"{k}={v:.3f}" for k, v in derived.items()))
    for m, s in modes.items():
        by_cpus: dict[str, int] = {}
        for p in s.get("processes", []):
            by_cpus[p["cpus"]] = by_cpus.get(p["cpus"], 0) + 1
        print(f"{m}: processes by allowed CPUs {by_cpus}")


if __name__ == "__main__":
    sys.exit(main())
