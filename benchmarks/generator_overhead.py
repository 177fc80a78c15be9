"""Generator overhead: tokens/s of a real generator process (leasing from Redis, scoring, pushing
through a real buffer process) vs the same vLLM engine settings generating the same prompts
standalone in the same run, with the same concurrency. Target: >= 95%.

    python benchmarks/generator_overhead.py --prompts 64 --n 8 --max-tokens 64 --out gen_overhead.json

The generator's rate is measured from its first heartbeat (engine up, prompts waiting) to the last
group's creation, all tokens counted from the trajectories in Redis; the standalone rate from the first request to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_generator(cfg, tmp: Path, num_prompts: int) -> dict:
    from asyncrl.config import dump_yaml
    from asyncrl.protocol import schema
    from asyncrl.protocol.keys import Keys, connect

    cfg_path = tmp / "bench.yaml"
    cfg_path.write_text(dump_yaml(cfg))
    keys, client = Keys(cfg.run.name), connect(cfg.buffer.redis_url)
    logs = open(tmp / "roles.log", "w")
    py = [sys.executable, "-m", "asyncrl"]
    buf = subprocess.Popen([*py, "buffer", str(cfg_path)], stdout=logs, stderr=subprocess.STDOUT, cwd=REPO)
    gen = subprocess.Popen([*py, "generator", str(cfg_path), "--id", "g0"], stdout=logs, stderr=subprocess.STDOUT,
                           cwd=REPO)
    # The clock starts at the generator's first heartbeat (engine up, connected); the prompts are
    # already released and waiting, so engine start-up is not counted against it.
    while client.hget(keys.gen("g0"), "state") is None:
        assert gen.poll() is None, (tmp / "roles.log").read_text()[-3000:]
        time.sleep(0.01)
    t_ready = time.time()
    try:
        while client.xlen(keys.trajectories) < num_prompts:
            assert gen.poll() is None and buf.poll() is None, (tmp / "roles.log").read_text()[-3000:]
            time.sleep(0.1)
        groups = [schema.decode(f[b"data"], schema.TrajectoryGroup) for _, f in client.xrange(keys.trajectories)]
        tokens = sum(g.num_tokens() for g in groups)
        seconds = max(g.created_at for g in groups) - t_ready
        return {"tokens": tokens, "seconds": seconds, "groups": len(groups), "tokens_per_s": tokens / seconds,
                "prompts": [g.prompt_id for g in groups]}
    finally:
        client.set(keys.stop, 1)
        buf.terminate()
        for p in (gen, buf):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()


def run_standalone(cfg, prompt_texts: list[str]) -> dict:
    from transformers import AutoTokenizer

    from asyncrl.tasks.data import encode_prompt
    from generators.vllm_engine import VllmEngine

    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    prompts = [encode_prompt(tok, p, cfg.data.chat_template) for p in prompt_texts]
    engine = VllmEngine(cfg, cfg.model_path)

    async def go():
        sem = asyncio.Semaphore(cfg.generator.max_concurrent_groups)  # the generator's concurrency

        async def one(p):
            async with sem:
                return await engine.generate_group(p, cfg.generator.n, lambda: 0)

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        return sum(len(s.token_ids) for g in outs for s in g), time.perf_counter() - t0

    try:
        try:  # the generator process runs on uvloop: so does the standalone engine here
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        tokens, seconds = loop.run_until_complete(go())
    finally:
        engine.shutdown()
    return {"tokens": tokens, "seconds": seconds, "groups": len(prompts), "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--model", default="", help="HF model dir (default: a tiny model written to a temp dir)")
    ap.add_argument("--warm-start-steps", type=int, default=30,
                    help="supervised warm start of the default tiny model: 30 -> ~4-token answers (the worst "
                         "case for per-group overhead); 0 -> random weights that write to max_tokens")
    ap.add_argument("--repeats", type=int, default=1,
                    help="pairs of runs, order alternating (gen, alone), (alone, gen), ...; the median pair ratio")
    ap.add_argument("--out", default="generator_overhead.json")
    args = ap.parse_args()

    from asyncrl.config import load_config
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.tools.tiny_model import write_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="gen-overhead-"))
    model = args.model or str(write_tiny_model(tmp / "model", seed=0, warm_start_steps=args.warm_start_steps))
    redis = LocalRedis(tmp / "redis").start()
    pairs = []
    try:
        for rep in range(args.repeats):
            cfg = load_config(None, [
                f"run.dir={tmp / 'runs'}", f"run.name=bench{rep}", f"model.path={model}",
                f"buffer.redis_url={redis.url}", f"data.num_prompts={args.prompts}", f"generator.n={args.n}",
                f"generator.max_tokens={args.max_tokens}", f"generator.max_model_len={64 + args.max_tokens}",
                f"generator.max_concurrent_groups={args.concurrency}",
                # every prompt released at once (no learner here): admission = (0 + staleness + 1) * groups/step
                f"learner.batch_groups={args.prompts}", "algorithm.max_staleness=0",
                f"buffer.prompt_backlog={args.prompts}", "logging.prometheus=false"])
            from buffers.service import load_prompts

            texts = [r.prompt for r in load_prompts(cfg)][: args.prompts]
            # Alternating order, so that a drift in machine load does not always favour one side.
            if rep % 2 == 0:
                gen = run_generator(cfg, tmp, args.prompts)
                alone = run_standalone(cfg, texts)
            else:
                alone = run_standalone(cfg, texts)
                gen = run_generator(cfg, tmp, args.prompts)
            gen.pop("prompts")
            pairs.append({"standalone": alone, "generator": gen,
                          "ratio": gen["tokens_per_s"] / alone["tokens_per_s"]})
    finally:
        redis.stop()
    print(f"{'pair':>4} {'':24s}{'tokens':>10s}{'seconds':>10s}{'tokens/s':>12s}{'ratio':>8s}")
    for i, pair in enumerate(pairs):
        for name, key in (("standalone vLLM engine", "standalone"), ("generator process", "generator")):
            r = pair[key]
            ratio = f"{pair['ratio']:.1%}" if key == "generator" else ""
            print(f"{i:>4} {name:24s}{r['tokens']:>10d}{r['seconds']:>10.2f}{r['tokens_per_s']:>12.1f}{ratio:>8s}")
    ratio = statistics.median(p["ratio"] for p in pairs)
    print(f"generator / standalone, median of {len(pairs)} pairs: {ratio:.1%} (target >= 95%)")
    result = {"config": vars(args), "pairs": pairs, "ratio": ratio}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
