"""Learner throughput: the production RL step against a plain Hugging Face LM step of the same shape.

    python benchmarks/learner_throughput.py --out runs/learner_throughput.json          # one H200
    python benchmarks/learner_throughput.py --device cpu --tiny                          # smoke test
    python benchmarks/learner_throughput.py --ragged --shapes 1.5b --num-seqs 512,2048   # RL-shaped batches
    python benchmarks/learner_throughput.py --ragged --device cpu --tiny                 # its smoke test

Variants, each on random weights from a Qwen2Config of the named shape, bf16 matmuls, SDPA attention:
  plain       bf16 model, `model(input_ids, labels=input_ids).loss.backward()`, torch.optim.AdamW
              (default foreach), zero_grad. No FSDP, no clipping.
  rl          what the learner does with its default switches: fp32 master weights under FSDP2
              `fully_shard` (world size 1, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)),
              fused AdamW, plus a frozen bf16 reference (not sharded at world size 1, as the learner
              does). One step = reference log-probs (no grad) + `learners.step.policy_update`
              (chunked log-probs of the completion tokens, decoupled-PPO loss, backward, grad
              clipping, optimizer step).
  rl_compile  rl + learner.compile (each decoder layer's forward under torch.compile).
  rl_tuned    rl_compile + learner.reshard_after_forward=false + learner.keep_logits_gb (logits kept
              for the backward instead of recomputed): the switches for one GPU with memory to spare.
  Any of them + "+switch" (see VARIANT_OPTS), e.g. rl+keep.

FLOPs per step: learners/flops.py, the count the learner's `mfu` metric uses. N = parameters in
Linear layers (the tied output head counted once, input embedding lookups not), per real token,
n_layers, d_attn = heads x head_dim, causal attention (each query sees s/2 keys on average):
  forward with grad + backward  6 N + 6 n_layers s d_attn
  forward without grad          2 N + 2 n_layers s d_attn
  plain = tokens x (6 N + 6 n_layers s d_attn);
  rl = tokens x (8 N_body + 8 n_layers s d_attn) + completion tokens x 8 V H: the head (V x H) runs
  on the completion tokens only, which are all the loss needs (prompt = seq / 8 here).
Recomputation (the chunked head's backward recomputes its logits) is work done but not counted.
MFU = counted FLOPs / step time / peak, the peak being a bf16 8192^3 matmul on random data
measured in the same run (fp32 512^3 on a CPU, labelled so).

--ragged: the learner's whole step as `Learner.train_step` runs it (learners/batch.py `build_step`,
learners/packing.py `plan_step`, reference log-probs over the micro-batches, `batch_targets`,
`policy_update` with token-budget micro-batches and gradient accumulation), on batches shaped like
RL: prompts uniform in [100, 300] tokens, completions lognormal (median 300) clipped to [32, 2048],
`--num-seqs` sequences a step (`--max-completion` the longest completion); next to `uniform`: the same number of real tokens in sequences of
`--uniform-seq` tokens (prompt = seq / 8), through the same code. Reported: real tokens (prompt +
completion) per second, the ratio ragged / uniform, pad fraction, micro-batches, peak memory, the
first step's time (compilation included). The switches are the learner's defaults, resolved as the
learner resolves them (micro-batch tokens from the memory free after the models are built,
activation checkpointing and compile `auto`), unless --micro-tokens / --checkpointing / --compile
say otherwise. --profile-dir: one more ragged step under torch.profiler (tables, gzipped trace).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import platform
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from learners.flops import TRAIN, ModelFlops, device_label, measure_peak_flops, step_flops  # noqa: E402

SHAPES = {  # Qwen2.5-0.5B / -1.5B (both tie their embeddings), and a CPU smoke-test shape
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=1024),
}


def qwen2_config(shape: str):
    from transformers import Qwen2Config

    s = SHAPES[shape]
    return Qwen2Config(**s, head_dim=s["hidden_size"] // s["num_attention_heads"], max_position_embeddings=32768,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_cache=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)


def build_model(shape: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(qwen2_config(shape), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: every Linear weight (a tied head is the embedding, once)."""
    mf = ModelFlops.of(model)
    return mf.body_params + mf.head_params


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_groups(batch: int, seq: int, prompt_len: int, vocab: int, seed: int):
    """Trajectory groups as generators send them: `batch` samples of `seq` tokens, no padding."""
    import numpy as np

    from asyncrl.protocol import schema

    rng = np.random.default_rng(seed)
    n_per_group = min(8, batch)
    assert batch % n_per_group == 0
    groups = []
    for gi in range(batch // n_per_group):
        comp_len = seq - prompt_len
        samples = [schema.Sample(
            completion_ids=schema.pack_i32(rng.integers(3, vocab, comp_len)),
            logprobs=schema.pack_f32(-rng.exponential(1.0, comp_len)),
            versions=schema.pack_i32(np.zeros(comp_len, dtype=np.int32)),
            reward=float(rng.random()), finish_reason="length") for _ in range(n_per_group)]
        groups.append(schema.TrajectoryGroup(
            schema_version=schema.SCHEMA_VERSION, group_id=f"p{gi}@e0", prompt_id=f"p{gi}", generator_id="bench",
            prompt_ids=schema.pack_i32(rng.integers(3, vocab, prompt_len)), samples=samples,
            sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time()))
    return groups


# Named variants and the switches they stand for; more can be added with "+": rl+compile+keep.
#   compile    torch.compile each decoder layer's forward (learner.compile)
#   noreshard  reshard_after_forward=False (learner.reshard_after_forward)
#   keep       keep the head's logits for the backward (learner.keep_logits_gb)
#   refshard   the reference under fully_shard even at world size 1
#   rootonly   one FSDP2 unit for the whole policy, none per layer (learner.shard_layers=false)
VARIANT_OPTS = {"rl_compile": {"compile"}, "rl_tuned": {"compile", "noreshard", "keep"}}


def compile_layers(model) -> None:
    # The layer's forward only: FSDP2's hooks stay outside the compiled region.
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=False)


def setup_plain(shape, device, batch, seq, opts):
    model = build_model(shape, torch.bfloat16, device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(3, model.config.vocab_size, (batch, seq), device=device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, ModelFlops.of(model).pass_flops(TRAIN, [seq] * batch, batch * seq), model


def setup_rl(shape, device, batch, seq, opts):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.config import Config
    from learners.batch import build_step
    from learners.packing import plan_step
    from learners.step import batch_targets, logprobs_N, policy_update, rank_micro_batches

    cfg = Config()
    cfg.learner.keep_logits_gb = 16.0 if "keep" in opts else 0.0
    cfg.learner.packing = False  # uniform rows: one padded micro-batch of the whole batch, no padding in it
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = build_model(shape, torch.float32, device)
    ref = copy.deepcopy(policy).to(torch.bfloat16).requires_grad_(False)
    # As the learner does (learners/trainer.py): at world size 1 the frozen reference is not sharded,
    # there being nothing to shard it over; `refshard` puts it under fully_shard anyway.
    shard = (policy, ref) if "refshard" in opts else (policy,)
    if "compile" in opts and "refshard" not in opts:
        compile_layers(ref)
    for m in shard:
        if "compile" in opts:
            compile_layers(m)
        for layer in m.model.layers if "rootonly" not in opts else ():
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward="noreshard" not in opts)
        fully_shard(m, mesh=mesh, mp_policy=mp, reshard_after_forward="noreshard" not in opts)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, weight_decay=cfg.learner.weight_decay,
                            fused=device.type == "cuda")
    prompt_len = max(1, seq // 8)
    groups = make_groups(batch, seq, prompt_len=prompt_len, vocab=policy.config.vocab_size, seed=0)
    b = build_step(groups, device=device)
    plan = plan_step(b.group_sizes, b.lengths, b.comp_len, world=1, minibatches=1, epochs=1, budget=batch * seq,
                     packed=False, seed=0)
    micro = rank_micro_batches(plan, 0)
    assert len(micro) == 1 and len(micro[0]) == batch
    last = {}

    def step():
        ref_logp = logprobs_N(ref, b, micro, cfg, 0)
        targets = batch_targets(policy, b, plan, cfg, 0, ref_logp)
        last.update(policy_update(policy, opt, b, plan, cfg, targets))
        last["ref_logp_mean"] = float(ref_logp.mean())

    def phases():
        """CUDA-event times of the two halves of one step: reference forward, policy update."""
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        ref_logp = logprobs_N(ref, b, micro, cfg, 0)
        ev[1].record()
        policy_update(policy, opt, b, plan, cfg, batch_targets(policy, b, plan, cfg, 0, ref_logp))
        ev[2].record()
        torch.cuda.synchronize()
        return {"ref_forward_s": ev[0].elapsed_time(ev[1]) / 1e3, "policy_update_s": ev[1].elapsed_time(ev[2]) / 1e3}

    step.phases = phases
    # The decoder runs on every token; the head on the completion tokens only (what the loss needs).
    flops = step_flops(ModelFlops.of(policy), [seq] * batch, b.num_tokens, reference=True)
    return step, flops, (policy, last)


def ragged_groups(num_seqs: int, vocab: int, seed: int, n: int = 8, uniform_seq: int = 0,
                  total_tokens: int = 0, max_completion: int = 2048):
    """`num_seqs` sequences in groups of `n`: RL-shaped lengths, or (uniform_seq > 0) sequences of
    uniform_seq tokens, as many as hold `total_tokens` real tokens (rounded up to whole groups)."""
    import numpy as np

    from asyncrl.protocol import schema

    rng = np.random.default_rng(seed)
    if uniform_seq:
        num_seqs = max(n, math.ceil(total_tokens / uniform_seq / n) * n)
    groups = []
    for gi in range(num_seqs // n):
        p_len = uniform_seq // 8 if uniform_seq else int(rng.integers(100, 301))
        comps = [uniform_seq - p_len] * n if uniform_seq else \
            np.clip(rng.lognormal(math.log(300), 0.9, n), 32, max_completion).astype(int).tolist()
        samples = [schema.Sample(
            completion_ids=schema.pack_i32(rng.integers(3, vocab, c)), logprobs=schema.pack_f32(-rng.exponential(1.0, c)),
            versions=schema.pack_i32(np.zeros(c, dtype=np.int32)), reward=float(rng.random()), finish_reason="stop")
            for c in comps]
        groups.append(schema.TrajectoryGroup(
            schema_version=schema.SCHEMA_VERSION, group_id=f"p{gi}@e0", prompt_id=f"p{gi}", generator_id="bench",
            prompt_ids=schema.pack_i32(rng.integers(3, vocab, p_len)), samples=samples,
            sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time()))
    return groups


def ragged_setup(kind, shape, device, args):
    """The learner's parts at its default switches unless the flags say otherwise: the policy (fp32
    master weights under FSDP2, bf16 compute), the frozen bf16 reference, AdamW, compile (`auto` as
    learner.compile), then micro-batch tokens and activation checkpointing from the memory free now
    (learners/setup.py `memory_needs`, learners/packing.py `choose_micro_batch`), as the learner sizes them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from asyncrl.config import Config
    from learners import packing
    from learners.setup import compile_wanted, fsdp_switches, keep_compile_cache, memory_needs

    cfg = Config()
    if args.keep_logits_gb is not None:
        cfg.learner.keep_logits_gb = args.keep_logits_gb
    cfg.learner.packing = kind != "padded"
    if device.type == "cuda":  # bf16 compute, as below and as the shipped GPU configs set it
        cfg.learner.mixed_precision.param_dtype = "bfloat16"
    cfg.learner.compile = {"on": True, "off": False}.get(args.compile, "auto")
    cfg.learner.activation_checkpointing = {"on": True, "off": False}.get(args.checkpointing, "auto")
    reshard, shard_layers = fsdp_switches(cfg.learner, 1)
    mesh = init_device_mesh(device.type, (1,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    policy = build_model(shape, torch.float32, device)
    ref = copy.deepcopy(policy).to(compute).requires_grad_(False)
    compiled = compile_wanted(cfg.learner.compile, device, policy)
    if compiled:  # as learners/setup.py does with learner.compile: each decoder layer, in place
        keep_compile_cache()
        for m in (policy, ref):
            for layer in m.model.layers:
                layer.compile()
    if shard_layers:
        for layer in policy.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(policy, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    attention = "sdpa (padded)"
    if cfg.learner.packing:
        for m in (policy, ref):
            attention = packing.packed_attention(m, device, compute)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-6, fused=device.type == "cuda")
    if device.type == "cuda":
        needs = memory_needs(cfg, [policy], 1, policy.config)  # no generator on this GPU
        budget, ckpt = packing.choose_micro_batch(torch.cuda.mem_get_info(device)[0], policy.config, compute,
                                                  cfg.learner.activation_checkpointing, needs, args.micro_tokens)
    else:
        budget, ckpt = args.micro_tokens or 8192, cfg.learner.activation_checkpointing is True
    if ckpt:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    switches = {"compile": compiled, "activation_checkpointing": ckpt, "attention": attention}
    return cfg, policy, ref, opt, budget, switches


def run_ragged(kind, shape, device, num_seqs, args, peak, total_tokens=0) -> dict:
    """One learner step as the learner runs it, on ragged or uniform sequences (see the docstring)."""
    from learners import packing
    from learners.batch import build_step
    from learners.step import batch_targets, logprobs_N, policy_update, rank_micro_batches

    cfg, policy, ref, opt, budget, switches = ragged_setup(kind, shape, device, args)
    vocab = policy.config.vocab_size
    groups = ragged_groups(num_seqs, vocab, seed=0, uniform_seq=args.uniform_seq if kind != "ragged" else 0,
                           total_tokens=total_tokens, max_completion=args.max_completion)
    last = {}

    def step(gs=groups):
        st = build_step(gs, device)
        plan = packing.plan_step(st.group_sizes, st.lengths, st.comp_len, world=1, minibatches=1, epochs=1,
                                 budget=budget, packed=cfg.learner.packing, seed=0)
        micro = rank_micro_batches(plan, 0)
        ref_n = logprobs_N(ref, st, micro, cfg, 0)
        targets = batch_targets(policy, st, plan, cfg, 0, ref_n)
        last.update(policy_update(policy, opt, st, plan, cfg, targets, 0, 1, 0))
        last["micro_batches"] = plan.micro_batches(0)
        last["pad_frac"] = 1 - sum(st.lengths) / plan.processed_tokens(st.lengths, cfg.learner.packing)
        return st

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, warm = [], []
    for i in range(args.warmup + args.steps):
        t = time.perf_counter()
        st = step()
        sync(device)
        (times if i >= args.warmup else warm).append(time.perf_counter() - t)
    med = statistics.median(times)
    real = sum(st.lengths)
    # learners/flops.py, as the learner's `mfu` counts it: reference forward + one forward and backward
    flops = step_flops(ModelFlops.of(policy), st.lengths, st.num_tokens, reference=True)
    row = {"variant": kind, "shape": shape, "num_seqs": st.num_seqs, "real_tokens": real,
           "completion_tokens": st.num_tokens, "micro_batch_tokens": budget, **switches,
           "micro_batches": last["micro_batches"], "pad_frac": last["pad_frac"], "step_s_median": med,
           "step_s_all": times, "warmup_s_all": warm, "real_tokens_per_s": real / med, "tflops_per_s": flops / med / 1e12,
           "mfu": flops / med / peak,
           "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
           "loss": last.get("loss"), "grad_norm": last.get("grad_norm")}
    if args.profile_dir and kind == "ragged":
        # Run by main_ragged once the row is written: a profile cut short by a time limit loses no row.
        few = groups[: max(1, args.trace_seqs // 8)]  # the trace: a step of the first groups, the same micro-batches
        row["_profile"] = lambda: save_profile(step, lambda: step(few), device, Path(args.profile_dir),
                                               f"{shape}_{num_seqs}")
    return row


def main_ragged(args, device, peak, meta) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape in args.shapes.split(","):
        for n in [int(x) for x in args.num_seqs.split(",")]:
            ragged = None
            for kind in ("ragged",) if args.no_uniform else ("ragged", "uniform"):
                failed = False
                try:
                    row = run_ragged(kind, shape, device, n, args, peak,
                                     total_tokens=ragged["real_tokens"] if ragged else 0)
                    if kind == "ragged":
                        ragged = row
                    else:
                        row["ragged_over_uniform"] = ragged["real_tokens_per_s"] / row["real_tokens_per_s"]
                        ragged["ragged_over_uniform"] = row["ragged_over_uniform"]
                except Exception as e:
                    traceback.print_exc()
                    row = {"variant": kind, "shape": shape, "num_seqs": n, "error": f"{type(e).__name__}: {e}"[:500]}
                    failed = True
                profile = row.pop("_profile", None)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("step_s_all", "profile")}), flush=True)
                out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                if profile is not None:
                    row["profile"] = profile()
                    print(json.dumps({"profile": {k: v for k, v in row["profile"].items() if k != "top_kernels"}}))
                    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
                    del profile
                # Compiled code holds on to the models' graphs: dropped, the next case compiles again
                # from the inductor cache on disk (its first step shows what a cached compile costs).
                torch._dynamo.reset()
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if failed and kind == "ragged":
                    break  # no uniform batch to compare with
    print_ragged_table(rows, meta)
    return 0 if all("error" not in r for r in rows) else 1


def print_ragged_table(rows, meta) -> None:
    print(f"\npeak (measured {meta['peak_label']} matmul, this run): {meta['peak_bf16_matmul_tflops']:.4g} TFLOP/s "
          f"on {meta['device']}")
    print(f"| {'shape':5} | {'variant':8} | {'seqs':>5} | {'real tok':>9} | {'micro tok':>9} | {'mbs':>4} | "
          f"{'ckpt':4} | {'comp':4} | {'first s':>7} | {'step s':>7} | {'real tok/s':>10} | {'TFLOP/s':>7} | "
          f"{'MFU':>5} | {'/uniform':>8} | {'mem GiB':>7} |")
    print("|" + "|".join("-" * w for w in (7, 10, 7, 11, 11, 6, 6, 6, 9, 9, 12, 9, 7, 10, 9)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']:5} | {r['variant']:8} | {r['num_seqs']:5} | failed: {r['error'][:80]}")
            continue
        mem = f"{r['max_mem_gib']:.1f}" if r["max_mem_gib"] is not None else "-"
        ratio = f"{r['ragged_over_uniform']:.2f}" if "ragged_over_uniform" in r else "-"
        first = f"{r['warmup_s_all'][0]:.1f}" if r["warmup_s_all"] else "-"
        print(f"| {r['shape']:5} | {r['variant']:8} | {r['num_seqs']:5} | {r['real_tokens']:9} | "
              f"{r['micro_batch_tokens']:9} | {r['micro_batches']:4} | {'on' if r['activation_checkpointing'] else 'off':4} | "
              f"{'on' if r['compile'] else 'off':4} | {first:>7} | {r['step_s_median']:7.3f} | "
              f"{r['real_tokens_per_s']:10.0f} | {r['tflops_per_s']:7.1f} | {100 * r['mfu']:4.1f}% | {ratio:>8} | {mem:>7} |")


KERNEL_FAMILIES = (("gemm", ("gemm", "cutlass", "xmma", "sm90_", "cublas")), ("attention", ("flash", "fmha", "attention")),
                   ("triton", ("triton",)), ("nccl", ("nccl",)), ("copy", ("memcpy", "memset", "copy", "cat")),
                   ("optimizer", ("adam", "multi_tensor")), ("softmax/reduce", ("softmax", "reduce", "logsumexp")))
# Host calls that wait for the device, and the operators that make them (item / float / int of a
# tensor, boolean indexing).
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::item")


def kernel_families(prof) -> tuple[dict[str, float], list]:
    """Device seconds by kernel family, and the top kernels (seconds, count, name)."""
    by_family: dict[str, float] = {}
    top = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not t or ev.key.startswith("ProfilerStep") or ev.key.startswith("aten::"):
            continue
        name = ev.key.lower()
        fam = next((f for f, keys in KERNEL_FAMILIES if any(k in name for k in keys)), "other")
        by_family[fam] = by_family.get(fam, 0.0) + t / 1e6
        top.append((t / 1e6, ev.count, ev.key[:90]))
    top.sort(reverse=True)
    return by_family, top


def save_profile(step, small_step, device: torch.device, out_dir: Path, tag: str) -> dict:
    """One more step under torch.profiler (host and device): kernel time by family, how busy the GPU
    was (kernel time / wall time; the host's tracing slows it, so a lower bound), the host-device
    syncs; written to OUT_DIR: learner_profile_TAG.txt (key_averages tables, by device and by host
    time); and learner_trace_TAG.json.gz, the Chrome trace of `small_step` (a step of a few of the
    groups, so that the file stays small; left out when over 15 MiB)."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    out_dir.mkdir(parents=True, exist_ok=True)
    sync(device)
    t0 = time.perf_counter()
    cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t0
    by_family, top = kernel_families(prof)
    events = prof.key_averages()
    syncs = {ev.key: ev.count for ev in events if ev.key in SYNC_CALLS + SYNC_OPS}
    tables = []
    for sort in ("self_device_time_total", "self_cpu_time_total"):
        try:
            tables.append(f"== sorted by {sort}\n" + events.table(sort_by=sort, row_limit=60, max_name_column_width=70))
        except (AttributeError, KeyError, ValueError):
            tables.append(f"== sorted by {sort}: not available\n")
    (out_dir / f"learner_profile_{tag}.txt").write_text("\n\n".join(tables))
    with profile(activities=[ProfilerActivity.CPU, *cuda]) as prof:
        small_step()
        sync(device)
    trace = out_dir / f"learner_trace_{tag}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(trace, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
    if trace.stat().st_size > 15 * 2**20:
        trace.unlink()
    kernel_s = sum(by_family.values())
    return {"wall_s": wall, "kernel_s_total": kernel_s, "gpu_busy_frac": kernel_s / wall,
            "kernel_s_by_family": by_family, "top_kernels": top[:15], "syncs": syncs,
            "trace": trace.name if trace.exists() else None}


def profile_step(step) -> dict:
    """One step under torch.profiler: device time by kernel family, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    # Host side, separately (its own overhead would blur the device timeline): where the CPU time of
    # one step goes, by operator / annotated region (FSDP, autograd, optimizer, compiled graphs).
    with profile(activities=[ProfilerActivity.CPU]) as cpu_prof:
        step()
        torch.cuda.synchronize()
    cpu_top = sorted(((ev.self_cpu_time_total / 1e6, ev.cpu_time_total / 1e6, ev.count, ev.key[:80])
                      for ev in cpu_prof.key_averages()), reverse=True)[:25]
    cpu_regions = sorted(((ev.cpu_time_total / 1e6, ev.count, ev.key[:80]) for ev in cpu_prof.key_averages()
                          if any(k in ev.key for k in ("FSDP", "Optimizer", "Torch-Compiled", "CompiledFunction",
                                                        "autograd::engine", "clip", "aten::_foreach"))),
                         reverse=True)[:20]
    by_family, top = kernel_families(prof)
    return {"wall_s": wall, "kernel_s_by_family": by_family, "kernel_s_total": sum(by_family.values()),
            "top_kernels": top[:25], "cpu_self_top": cpu_top, "cpu_regions": cpu_regions}


def run_variant(variant, shape, device, batch, seq, warmup, steps, peak, profile=False):
    base, *mods = variant.split("+")
    setup = setup_plain if base == "plain" else setup_rl
    opts = set(mods) | VARIANT_OPTS.get(base, set())
    t_setup = time.perf_counter()
    step, flops, keep = setup(shape, device, batch, seq, opts)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    sync(device)
    warm_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = batch * seq
    row = {"variant": variant, "shape": shape, "seq": seq, "batch": batch, "tokens": tokens,
           "matmul_params": matmul_params(keep[0] if isinstance(keep, tuple) else keep),
           "step_s_median": med, "step_s_all": times, "tokens_per_s": tokens / med, "flops_per_step": flops,
           "tflops_per_s": flops / med / 1e12, "mfu": flops / med / peak, "total_s": time.perf_counter() - t_setup,
           "warmup_s": warm_s,
           "max_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    if isinstance(keep, tuple):
        row["last_stats"] = {k: v for k, v in keep[1].items() if math.isfinite(v)}
    if profile and device.type == "cuda":
        if hasattr(step, "phases"):
            row["phases"] = step.phases()
        row["profile"] = profile_step(step)
        print(json.dumps({"variant": variant, "phases": row.get("phases"), **row["profile"]}, indent=None), flush=True)
    return row


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shape, short sequences (CPU smoke test)")
    p.add_argument("--shapes", default="0.5b,1.5b")
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per step; batch = tokens // seq")
    p.add_argument("--variants", default="plain,rl_tuned", help="run at every sequence length")
    p.add_argument("--extra-variants", default="rl,rl_compile", help="run at --extra-seqs only")
    p.add_argument("--extra-seqs", default="2048", help="sequence lengths that also run --extra-variants ('' = none)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="runs/learner_throughput.json")
    p.add_argument("--profile", action="store_true", help="also profile one step of each variant (CUDA)")
    p.add_argument("--ragged", action="store_true", help="RL-shaped batches through the learner's whole step")
    p.add_argument("--num-seqs", default="512,2048", help="--ragged: sequences a step")
    p.add_argument("--uniform-seq", type=int, default=2048, help="--ragged: length of the uniform sequences")
    p.add_argument("--micro-tokens", type=int, default=0, help="--ragged: learner.micro_batch_tokens (0: default)")
    p.add_argument("--keep-logits-gb", type=float, default=None,
                   help="--ragged: learner.keep_logits_gb (default: the config's default)")
    p.add_argument("--checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="--ragged: learner.activation_checkpointing (auto: as the learner chooses it)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="--ragged: learner.compile, each decoder layer compiled (auto: as the learner chooses it)")
    p.add_argument("--max-completion", type=int, default=2048, help="--ragged: longest completion (tokens)")
    p.add_argument("--profile-dir", default="", help="--ragged: profile one more ragged step, write its tables "
                   "and the gzipped Chrome trace of a step of --trace-seqs sequences here")
    p.add_argument("--trace-seqs", type=int, default=64, help="--ragged: sequences of the traced step")
    p.add_argument("--no-uniform", action="store_true", help="--ragged: skip the uniform batches of the same tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.seqs, args.tokens, args.extra_seqs = "tiny", "32,64", 256, args.extra_seqs and "64"
        if args.ragged:
            args.num_seqs, args.uniform_seq, args.warmup, args.steps = "16,32", 512, 1, 2
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    import transformers

    peak = measure_peak_flops(device)  # in this run, not the learner's cache
    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
            "peak_bf16_matmul_tflops": peak / 1e12, "peak_label": device_label(device), "argv": sys.argv[1:]}
    print(json.dumps(meta), flush=True)
    if args.ragged:
        rc = main_ragged(args, device, peak, meta)
        dist.destroy_process_group()
        return rc
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    plan = [(v, sh, int(s)) for sh in args.shapes.split(",") for s in args.seqs.split(",")
            for v in args.variants.split(",") if v]
    extra_seqs = {int(s) for s in args.extra_seqs.split(",") if s}
    plan += [(v, sh, s) for sh in args.shapes.split(",") for s in sorted(extra_seqs)
             for v in args.extra_variants.split(",") if v]
    for variant, shape, seq in plan:
        batch = max(1, args.tokens // seq)
        try:
            row = run_variant(variant, shape, device, batch, seq, args.warmup, args.steps, peak, args.profile)
        except Exception as e:  # a failed variant is reported in the table and JSON, the others still run
            traceback.print_exc()
            row = {"variant": variant, "shape": shape, "seq": seq, "batch": batch, "error": f"{type(e).__name__}: {e}"[:500]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "step_s_all"}), flush=True)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        gc.collect()  # the models of a finished variant sit in reference cycles
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print_table(rows, meta)
    dist.destroy_process_group()
    return 0 if all("error" not in r for r in rows) else 1


def print_table(rows, meta) -> None:
    plain = {(r["shape"], r["seq"]): r for r in rows if r["variant"] == "plain" and "error" not in r}
    print(f"\npeak (measured bf16 8192^3 matmul): {meta['peak_bf16_matmul_tflops']:.0f} TFLOP/s on {meta['device']}")
    print(f"| {'shape':5} | {'seq':>5} | {'batch':>5} | {'variant':10} | {'step s':>7} | {'tokens/s':>9} | "
          f"{'TFLOP/s':>7} | {'MFU':>5} | {'vs plain':>8} | {'mem GiB':>7} |")
    print("|" + "|".join("-" * w for w in (7, 7, 7, 12, 9, 11, 9, 7, 10, 9)) + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']:5} | {r['seq']:5} | {r['batch']:5} | {r['variant']:10} | failed: {r['error'][:80]}")
            continue
        base = plain.get((r["shape"], r["seq"]))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        mem = f"{r['max_mem_gib']:.1f}" if r["max_mem_gib"] is not None else "-"
        print(f"| {r['shape']:5} | {r['seq']:5} | {r['batch']:5} | {r['variant']:10} | {r['step_s_median']:7.3f} | "
              f"{r['tokens_per_s']:9.0f} | {r['tflops_per_s']:7.1f} | {100 * r['mfu']:4.1f}% | {ratio:>8} | {mem:>7} |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
