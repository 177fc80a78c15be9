"""The generator's vLLM path on CUDA (vLLM's CUDA build): our engine wrapper's throughput next to the raw
engine on the same prompts, a weight push through the worker extension, and greedy equivalence with
the Hugging Face model after the push.

    PYTHONPATH=/tmp/vsite VLLM_USE_FLASHINFER_SAMPLER=0 python benchmarks/vllm_cuda_check.py --out r.json

Single GPU: the push uses the gloo group (host staging) because NCCL cannot put two ranks on one
device; on two GPUs the learner's NCCL path is the same code with backend "nccl".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

import torch

from asyncrl.config import load_config
from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets


def qwen05_config(vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=vocab, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                       torch_dtype="bfloat16")


def write_model(path, config, dtype):
    from transformers import AutoModelForCausalLM

    from asyncrl.tools.tiny_model import build_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return model


async def raw_throughput(engine, prompts, n, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0,
                        detokenize=False)

    async def one(p):
        final = None
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=p), sp, request_id=uuid.uuid4().hex):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    t0 = time.perf_counter()
    toks = sum(await asyncio.gather(*[one(p) for p in prompts]))
    return toks / (time.perf_counter() - t0)


async def ours_throughput(engine, prompts, n, max_tokens):
    """Our generate_group path (DELTA streaming, per-token logprobs and version stamps), with the same
    fixed lengths as the raw run (ignore_eos) so both generate the same number of tokens."""
    orig = engine.sampling_params

    def fixed_length(*args, **kwargs):
        sp = orig(*args, **kwargs)
        sp.ignore_eos, sp.max_tokens = True, max_tokens
        return sp

    engine.sampling_params = fixed_length
    try:
        t0 = time.perf_counter()
        groups = await asyncio.gather(*[engine.generate_group(p, n, lambda: 0) for p in prompts])
        dt = time.perf_counter() - t0
    finally:
        engine.sampling_params = orig
    assert all(len(s.logprobs) == len(s.token_ids) == len(s.versions) for g in groups for s in g)
    return sum(len(s.token_ids) for g in groups for s in g) / dt


def push(engine, sd, version, gid, backend="gloo", repeats=1):
    """Learner side in this process, receiver = the engine's worker extension. gloo: the buckets are
    packed into host memory and broadcast; ipc: packed on the GPU and handed over as CUDA IPC handles.
    Returns one result per push (versions version .. version + repeats - 1) when repeats > 1."""
    sender = WeightSender("127.0.0.1", 0, backend, join_timeout_s=120, sync_timeout_s=300)
    frames = {}
    pack_device = torch.device("cuda") if backend == "ipc" else torch.device("cpu")

    async def go():
        loop = asyncio.get_running_loop()
        opened = loop.run_in_executor(None, sender.open_epoch, [f"{gid}.0"],
                                      lambda info: frames.setdefault("e", schema.encode(info)), lambda *a, **k: None)
        while "e" not in frames:
            await asyncio.sleep(0.01)
        assert await engine.join(frames["e"], gid, 120)
        await opened
        buckets = plan_buckets([(k, v.dtype, tuple(v.shape)) for k, v in sd.items()], 256 * 2**20)
        nbytes = sum(b.nbytes for b in buckets)
        out = []
        for v in range(version, version + repeats):
            ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=v, epoch=sender.epoch,
                                            buckets=buckets, announced_at=time.time())
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sent = loop.run_in_executor(None, lambda a=ann: sender.broadcast(
                buckets, pack_buckets(buckets, iter(sd.items()), pack_device), version=a.version))
            stats = await engine.update_weights(schema.encode(ann), "keep", 300)
            sums = await sent
            dt = time.perf_counter() - t0
            assert stats["checksums"] == sums, "checksums differ between learner and vLLM worker"
            out.append({"backend": backend, "seconds": dt, "GB": nbytes / 1e9, "GB_per_s": nbytes / 1e9 / dt,
                        "ms_per_GB": 1e3 * dt / (nbytes / 1e9), "pause_s": stats["pause_s"],
                        "receive_s": stats["receive_s"], "stage_s": stats["stage_s"],
                        "load_s": stats.get("load_s", stats["receive_s"]), "load_path": stats.get("load_path", "")})
        sender.close()
        return out if repeats > 1 else out[0]

    return go


async def greedy(engine, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = []
    for p in prompts:
        final = None
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=p), SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False),
                                                request_id=uuid.uuid4().hex):
            final = out
        outs.append(list(final.outputs[0].token_ids))
    return outs


def stage(msg):
    print(f"== {time.strftime('%H:%M:%S')} {msg}", flush=True)


def main():
    asyncio.run(amain())


async def amain():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="vllm_cuda_check.json")
    ap.add_argument("--work", default="/tmp/asyncrl-cuda")
    args = ap.parse_args()

    from asyncrl.tools.tiny_model import tiny_config
    from generators.vllm_engine import VllmEngine

    results = {"device": torch.cuda.get_device_name(0)}
    import vllm

    results["vllm"] = vllm.__version__
    # 1. Tiny fp32 model: push perturbed weights, then greedy must equal HF greedy token for token.
    tiny_path = f"{args.work}/tiny"
    hf = write_model(tiny_path, tiny_config(128), torch.float32)
    cfg = load_config(None, [f"model.path={tiny_path}", "generator.dtype=float32", "generator.enforce_eager=false",
                             "generator.gpu_memory_utilization=0.3", "generator.max_model_len=256"])
    stage("tiny engine start")
    engine = VllmEngine(cfg, tiny_path)
    stage("tiny engine up; HF greedy")
    torch.manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = hf.cuda().eval()
    prompts = [[13 + i, 14 + i, 15, 83] for i in range(8)]
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          eos_token_id=2, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    stage("tiny push")
    results["tiny_push"] = await push(engine, {k: v.detach().cpu() for k, v in hf.state_dict().items()}, 1, "gt")()
    stage("tiny greedy")
    got = await greedy(engine, prompts, 16)
    stage(f"tiny equal={got == want}")
    results["tiny_greedy_equal"] = got == want
    results["tiny_greedy_mismatches"] = sum(a != b for a, b in zip(got, want, strict=True))
    engine.shutdown()
    del hf
    torch.cuda.empty_cache()

    # 2. Qwen2.5-0.5B shape in bf16: throughput of our wrapper vs the raw engine, and a push.
    q_path = f"{args.work}/q05"
    q = write_model(q_path, qwen05_config(151936), torch.bfloat16)
    cfg = load_config(None, [f"model.path={q_path}", "generator.dtype=bfloat16", "generator.enforce_eager=false",
                             "generator.gpu_memory_utilization=0.6", "generator.max_model_len=2048",
                             "generator.max_tokens=512", "generator.temperature=1.0"])
    stage("q05 engine start")
    engine = VllmEngine(cfg, q_path)
    stage("q05 throughput")
    import random

    rng = random.Random(0)
    bench_prompts = [[rng.randint(3, 90) for _ in range(64)] for _ in range(64)]
    n = 8

    async def both():
        await raw_throughput(engine, bench_prompts[:4], n, 32)  # warm-up
        raw = await raw_throughput(engine, bench_prompts, n, 512)
        ours = await ours_throughput(engine, bench_prompts, n, 512)
        raw2 = await raw_throughput(engine, bench_prompts, n, 512)
        return raw, ours, raw2

    raw, ours, raw2 = await both()
    results["q05_tokens_per_s"] = {"raw_engine": raw, "asyncrl_generate_group": ours, "raw_engine_again": raw2,
                                   "ratio": ours / ((raw + raw2) / 2)}
    stage(f"q05 push after {results['q05_tokens_per_s']}")
    results["q05_push"] = await push(engine, {k: v.detach() for k, v in q.state_dict().items()}, 1, "gq")()
    engine.shutdown()
    print(json.dumps(results, indent=2))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
