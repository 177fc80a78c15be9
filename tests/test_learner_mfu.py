"""The learner's speed as `mfu` / `tflops`: one FLOP count (learners/flops.py) shared with the
throughput benchmark, the device's peak measured once and cached, micro-batches and activation
checkpointing sized from the memory free, and a step path that does not wait on the device per
micro-batch."""

import collections
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.observe.status import snapshot
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import ensure_groups
from learners import flops, packing
from tests.helpers import fixed_groups, make_group

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def qwen(tie: bool = True, **shape):
    from transformers import AutoModelForCausalLM, Qwen2Config

    s = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=32) | shape
    cfg = Qwen2Config(**s, head_dim=s["hidden_size"] // s["num_attention_heads"], tie_word_embeddings=tie,
                      use_cache=False)
    return AutoModelForCausalLM.from_config(cfg)


def test_flops_of_a_small_decoder_by_hand():
    # Per layer: q 8x8, k 4x8, v 4x8, o 8x8, gate and up 16x8, down 8x16 = 576; the head 32 x 8.
    for tie in (True, False):
        mf = flops.ModelFlops.of(qwen(tie))
        assert (mf.body_params, mf.head_params, mf.num_layers, mf.attn_dim) == (2 * 576, 256, 2, 8)
    mf = flops.ModelFlops.of(qwen())
    # Sequences of 3 and 5 tokens, 4 completion tokens: per pass factor x (1152 x 8 + 2 x 8 x (9 + 25) + 256 x 4).
    one = 1152 * 8 + 2 * 8 * (9 + 25) + 256 * 4
    assert mf.pass_flops(flops.TRAIN, [3, 5], 4) == 6 * one
    assert flops.step_flops(mf, [3, 5], 4) == 6 * one
    assert flops.step_flops(mf, [3, 5], 4, reference=True) == 8 * one
    assert flops.step_flops(mf, [3, 5], 4, epochs=2, reference=True, proximal=True) == 16 * one
    critic = flops.ModelFlops(body_params=1000, head_params=0, num_layers=2, attn_dim=8)
    body = 1000 * 8 + 2 * 8 * 34
    assert flops.step_flops(mf, [3, 5], 4, critic=critic) == 6 * one + 8 * body


def test_the_benchmark_counts_with_the_learners_function():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import learner_throughput as bench
    finally:
        sys.path.pop(0)
    assert bench.step_flops is flops.step_flops and bench.ModelFlops is flops.ModelFlops
    assert bench.matmul_params(qwen()) == 2 * 576 + 256


def test_peak_is_measured_once_per_device_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    real = flops.measure_peak_flops
    monkeypatch.setattr(flops, "measure_peak_flops", lambda dev: calls.append(dev) or real(dev, size=128, reps=2))
    cpu = torch.device("cpu")
    peak, source = flops.device_peak_flops(cpu)
    assert peak > 0 and source.startswith("measured cpu fp32") and len(calls) == 1
    cached = json.loads((tmp_path / "asyncrl" / "peak_flops.json").read_text())
    assert cached == {flops.device_label(cpu): peak}
    again, source = flops.device_peak_flops(cpu)
    assert again == peak and "cached" in source and len(calls) == 1
    assert flops.device_peak_flops(cpu, configured_tflops=989.0) == (989e12, "learner.peak_tflops")
    (tmp_path / "asyncrl" / "peak_flops.json").write_text("{not json")
    remeasured, _ = flops.device_peak_flops(cpu)
    assert remeasured > 0 and len(calls) == 2


def _h100_activation_slope() -> float:
    """Bytes a token added to the peak memory of the 1.5B ragged step on an H100, between 4096- and
    12288-token micro-batches (the benchmark's results)."""
    rows = {}
    for name in ("learner_ragged_h100_defaults", "learner_ragged_h100_micro12288"):
        r = json.loads((REPO / "benchmarks" / "results" / f"{name}.json").read_text())["rows"][0]
        rows[r["micro_batch_tokens"]] = r["max_mem_gib"] * GIB
    return (rows[12288] - rows[4096]) / (12288 - 4096)


def qwen_1_5b_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                       num_key_value_heads=2, vocab_size=151936)


def test_activation_bytes_match_the_h100_measurement():
    predicted = packing.activation_bytes_per_token(qwen_1_5b_config(), torch.bfloat16, False)
    assert 0.95 < predicted / _h100_activation_slope() < 1.15
    assert packing.activation_bytes_per_token(qwen_1_5b_config(), torch.bfloat16, True) < predicted / 5


def test_micro_batches_fit_the_free_memory_and_checkpoint_only_when_needed():
    c, bf16 = qwen_1_5b_config(), torch.bfloat16
    params = 1_543_714_304
    # fp32 gradient + two AdamW moments per parameter, the bf16 copies kept at world size 1
    needs = packing.MemoryNeeds(pending=12 * params + 2 * params,
                                reserve=packing.head_workspace_bytes(c, bf16) + 4 * GIB)
    resident = 4 * params + 2 * params  # fp32 policy + bf16 reference, loaded before the sizing
    free = 79 * GIB - resident
    tokens, ckpt = packing.choose_micro_batch(free, c, bf16, "auto", needs)
    assert not ckpt and 8192 <= tokens <= 16384 and tokens % 1024 == 0
    # What the step would then hold stays inside the device, by the measured per-token bytes.
    assert resident + needs.pending + needs.reserve + tokens * _h100_activation_slope() < 75 * GIB
    # A device with a generator's engine beside it: only checkpointing fits 4096 tokens.
    tokens, ckpt = packing.choose_micro_batch(32 * GIB, c, bf16, "auto", needs)
    assert ckpt and tokens >= 4096
    # Explicit switches are kept; a requested size that does not fit without checkpointing turns it on.
    assert packing.choose_micro_batch(32 * GIB, c, bf16, False, needs) == (2048, False)
    assert packing.choose_micro_batch(free, c, bf16, True, needs, requested_tokens=6000) == (6000, True)
    assert packing.choose_micro_batch(free, c, bf16, "auto", needs, requested_tokens=6000) == (6000, False)
    assert packing.choose_micro_batch(free, c, bf16, "auto", needs, requested_tokens=60000) == (60000, True)


def test_memory_needs_count_the_state_still_to_come(tiny_model):
    from transformers import AutoModelForCausalLM

    from learners.setup import memory_needs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = load_config(None, [f"model.path={tiny_model}", "learner.keep_logits_gb=1",
                             "learner.mixed_precision.param_dtype=bfloat16"])
    n = sum(p.numel() for p in model.parameters())
    needs = memory_needs(cfg, [model], 1, model.config, generator_bytes=5)
    assert needs.pending == 12 * n + 2 * n  # world 1: the bf16 copies stay gathered
    assert needs.reserve == packing.head_workspace_bytes(model.config, torch.bfloat16) + GIB + 5
    assert memory_needs(cfg, [model], 2, model.config).pending == 12 * n


# Operators that make the host wait for the device: item / float / bool of a tensor, boolean indexing.
SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::is_nonzero"}


class SyncCounter(TorchDispatchMode):
    """Counts the operators that wait for the device, except transformers' packed-row detection, which
    only the CPU's SDPA path runs (with FlashAttention varlen transformers makes no mask)."""

    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in SYNC_OPS:
            stack = traceback.extract_stack()
            if not any(f.filename.endswith("masking_utils.py") for f in stack):
                ours = [f for f in stack if "/learners/" in f.filename or "/asyncrl/" in f.filename]
                at = f"{ours[-1].filename}:{ours[-1].lineno}" if ours else "?"
                self.where[f"{func._schema.name} at {at}"] += 1
        return func(*args, **(kwargs or {}))


def test_the_update_waits_on_the_device_only_for_its_statistics(tiny_model):
    from transformers import AutoModelForCausalLM

    from learners.batch import build_step
    from learners.step import batch_targets, policy_update

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    cfg = load_config(None, [f"model.path={tiny_model}"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    step = build_step(fixed_groups(8), device=torch.device("cpu"))
    for budget in (10**6, 40):  # one micro-batch, then several
        plan = packing.plan_step(step.group_sizes, step.lengths, step.comp_len, world=1, minibatches=2, epochs=1,
                                 budget=budget, packed=True, seed=0)
        targets = batch_targets(model, step, plan, cfg)
        with SyncCounter() as syncs:
            stats = policy_update(model, opt, step, plan, cfg, targets)
        assert plan.micro_batches(0) >= (2 if budget > 1000 else 6)
        # The statistics come back in one copy (Tensor.tolist), which dispatches no per-value item.
        assert not syncs.where, dict(syncs.where)
        assert math.isfinite(stats["loss"]) and stats["entropy"] > 0


def test_a_learner_step_reports_mfu_in_its_row_line_and_status(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    name, steps, per_step = "mfu", 2, 2
    redis = LocalRedis(tmp_path / "redis").start()
    try:
        # Reference (kl_coef > 0) and proximal (two epochs) passes: both counted.
        cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"run.max_steps={steps}",
                                 f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                                 f"learner.batch_groups={per_step}", "algorithm.max_staleness=1000",
                                 "algorithm.kl_coef=0.01", "learner.ppo_epochs=2"])
        path = tmp_path / f"{name}.yaml"
        path.write_text(dump_yaml(cfg))
        client, keys = connect(redis.url), Keys(name)
        ensure_groups(client, keys)
        for i in range(steps * per_step):
            client.xadd(keys.trajectories, {"data": schema.encode(make_group(f"p{i}@e0", num_samples=4, num_tokens=5))})
        log = subprocess.run([sys.executable, "-m", "asyncrl", "learner", str(path)], capture_output=True, text=True,
                             timeout=600)
        assert log.returncode == 0, (log.stdout + log.stderr)[-3000:]
        rows = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        status = snapshot(client, keys, cfg)["learner"]
    finally:
        redis.stop()
    from transformers import AutoModelForCausalLM

    mf = flops.ModelFlops.of(AutoModelForCausalLM.from_pretrained(tiny_model))
    want = flops.step_flops(mf, [3 + 5] * 8, 5 * 8, epochs=2, reference=True, proximal=True)
    peak = json.loads((tmp_path / "cache" / "asyncrl" / "peak_flops.json").read_text())
    assert list(peak) == [flops.device_label(torch.device("cpu"))]
    assert len(rows) == steps
    for r in rows:
        assert r["tflops"] * 1e12 * r["compute_s"] == pytest.approx(want, rel=1e-6)
        assert r["mfu"] == pytest.approx(r["tflops"] * 1e12 / next(iter(peak.values())), rel=1e-6)
    assert [line.count(" mfu=") for line in log.stdout.splitlines() if line.startswith("step=")] == [1] * steps
    assert status["mfu"] == pytest.approx(rows[-1]["mfu"], rel=1e-6)
