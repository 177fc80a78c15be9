"""Weight sync on one GPU shared by the learner and vLLM: `weights.backend=ipc` (the learner's buckets in
one flat GPU buffer, handed to vLLM's worker as a CUDA IPC handle) against gloo through host memory,
in the same run, at the Qwen2.5-0.5B and 1.5B shapes in bf16 (random weights; nothing downloaded).
Also the generator against raw vLLM at the 0.5B shape (64 prompts x n=8 x 512 tokens), raw and ours
interleaved so that drift between runs falls on both.

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/weight_push_cuda.py \\
        --json benchmarks/results/weight_push_h200.json

Each push: the learner side (this process) packs its GPU state dict into buckets and sends them; the
engine pauses, its worker receives and loads them, and both sides' checksums must agree. `seconds` is
the whole push, `pause_s` the time generation stood still, `ms_per_GB` the push per GB of weights,
`load_s` the load into vLLM's parameters. Each backend is measured with each `--loads` mode
(`weights.load`: `reload`, vLLM's generic in-place reload; `direct`, one copy per tensor), and greedy
output after a direct load must equal greedy output after a reload of the same weights.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics

import torch
from vllm_cuda_check import greedy, ours_throughput, push, raw_throughput, stage, write_model

from asyncrl.config import load_config


def qwen_config(shape: str, vocab: int = 151936):
    from transformers import Qwen2Config

    dims = {"0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
            "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, head_dim=128, tie_word_embeddings=True),
            # A smoke test of this script on CPU (vLLM's CPU build; gloo only).
            "cpu-smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)}[shape]
    return Qwen2Config(vocab_size=vocab, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0, torch_dtype="bfloat16", **dims)


def summary(pushes: list[dict]) -> dict:
    steady = pushes[1:] or pushes  # the first push of an epoch maps buffers and warms the allocator
    return {"seconds_median": statistics.median(p["seconds"] for p in steady),
            "pause_s_median": statistics.median(p["pause_s"] for p in steady),
            "load_s_median": statistics.median(p["load_s"] for p in steady),
            "ms_per_GB_median": statistics.median(p["ms_per_GB"] for p in steady),
            "first_seconds": pushes[0]["seconds"], "GB": pushes[0]["GB"], "pushes": pushes}


async def amain():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="weight_push_cuda.json")
    ap.add_argument("--work", default="/tmp/asyncrl-push")
    ap.add_argument("--shapes", default="0.5B,1.5B")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--throughput-rounds", type=int, default=3, help="raw/ours pairs at the first shape (0: none)")
    ap.add_argument("--backends", default="gloo,ipc")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (a faster engine start; loads are the same)")
    ap.add_argument("--loads", default="reload,direct", help="weights.load modes measured for each backend")
    args = ap.parse_args()

    import vllm

    from generators.vllm_engine import VllmEngine

    cuda = torch.cuda.is_available()
    results = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "vllm": vllm.__version__, "torch": torch.__version__,
               "shapes": {}}
    for si, shape in enumerate(args.shapes.split(",")):
        path = f"{args.work}/{shape}"
        model = write_model(path, qwen_config(shape), torch.bfloat16)
        # The learner's weights, on the GPU.
        sd = {k: v.detach().to("cuda" if cuda else "cpu") for k, v in model.state_dict().items()}
        del model
        cfg = load_config(None, [f"model.path={path}", "generator.dtype=bfloat16", f"generator.enforce_eager={args.eager or not cuda}",
                                 "generator.gpu_memory_utilization=0.5", "generator.max_model_len=2048",
                                 "generator.max_tokens=512", "generator.temperature=1.0"])
        stage(f"{shape} engine start")
        engine = VllmEngine(cfg, path)
        row: dict = {"params": sum(v.numel() for v in sd.values())}
        if si == 0 and args.throughput_rounds:
            rng = random.Random(0)
            prompts = [[rng.randint(3, 90) for _ in range(64)] for _ in range(64)]
            await raw_throughput(engine, prompts[:4], 8, 32)  # warm-up
            raws, ours = [], []
            for _ in range(args.throughput_rounds):
                raws.append(await raw_throughput(engine, prompts, 8, 512))
                ours.append(await ours_throughput(engine, prompts, 8, 512))
            raws.append(await raw_throughput(engine, prompts, 8, 512))
            # Each of ours against the mean of the raw runs on either side of it.
            ratios = [o / ((raws[i] + raws[i + 1]) / 2) for i, o in enumerate(ours)]
            row["generator"] = {"raw_tokens_per_s": raws, "ours_tokens_per_s": ours, "ratios": ratios,
                                "ratio_median": statistics.median(ratios)}
            stage(f"{shape} generator / raw: {row['generator']['ratio_median']:.3f} ({ratios})")
        backends = [b for b in args.backends.split(",") if cuda or b == "gloo"]
        version = 1
        for backend in backends:
            row[backend] = {}
            for load in args.loads.split(","):
                stage(f"{shape} push over {backend}, weights.load={load}")
                engine.cfg.weights.load = load
                # One generator id for all: the worker keeps its member id across epochs.
                pushes = await push(engine, sd, version, "p", backend, args.repeats)()
                version += args.repeats
                assert all(p["load_path"] == load for p in pushes), [p["load_path"] for p in pushes]
                row[backend][load] = summary(pushes)
                r = row[backend][load]
                stage(f"{shape} {backend} {load}: {r['seconds_median']:.3f} s, pause {r['pause_s_median']:.3f} s, "
                      f"load {r['load_s_median']:.3f} s, {r['ms_per_GB_median']:.1f} ms/GB")
        # The same weights through both paths must give the same greedy output.
        prompts = [[rng_i % 90 + 3 for rng_i in range(i, i + 24)] for i in range(8)]
        outs = {}
        for load in ("direct", "reload"):
            engine.cfg.weights.load = load
            await push(engine, sd, version, "p", backends[-1], 1)()
            version += 1
            outs[load] = await greedy(engine, prompts, 16)
        row["direct_equals_reload_greedy"] = outs["direct"] == outs["reload"]
        stage(f"{shape} greedy after direct == after reload: {row['direct_equals_reload_greedy']}")
        results["shapes"][shape] = row
        with open(args.json, "w") as f:  # after each shape: a run cut short keeps what it measured
            json.dump(results, f, indent=2)
        engine.shutdown()
        del sd
        if cuda:
            torch.cuda.empty_cache()

    print("| shape | GB | backend | weights.load | push s | pause s | load s | ms/GB |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for shape, r in results["shapes"].items():
        for backend in ("gloo", "ipc"):
            for load, x in r.get(backend, {}).items():
                print(f"| {shape} | {x['GB']:.2f} | {backend} | {load} | {x['seconds_median']:.3f} | "
                      f"{x['pause_s_median']:.3f} | {x['load_s_median']:.3f} | {x['ms_per_GB_median']:.1f} |")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    asyncio.run(amain())
