"""generator.sleep: in sync mode on CUDA the vLLM engine sleeps while the learner steps and wakes for
the next group or weights. The state logic against a recording stand-in for AsyncLLM (CPU), and a
whole `asyncrl run run.mode=sync` on a GPU, where the engine really sleeps and the learner's weights
arrive over ipc."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from asyncrl.config import load_config
from generators.vllm_engine import VllmEngine, sleep_enabled


def test_sleep_is_for_sync_mode_on_cuda_only():
    sync = load_config(None, ["run.mode=sync"])
    assert sleep_enabled(sync, on_cpu=False)
    assert not sleep_enabled(sync, on_cpu=True)
    assert not sleep_enabled(load_config(None, ["run.mode=async"]), on_cpu=False)
    assert not sleep_enabled(load_config(None, ["run.mode=sync", "generator.sleep=off"]), on_cpu=False)


class _Recorder:
    """Records the sleep-mode calls an AsyncLLM would receive, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    async def sleep(self, level: int = 1):
        self.calls.append(("sleep", level))
        await asyncio.sleep(0.05)  # a sleep takes a while: a group arriving meanwhile must wait for it

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))


def _engine(*overrides: str) -> tuple[VllmEngine, _Recorder]:
    cfg = load_config(None, ["run.mode=sync", *overrides])
    eng = VllmEngine.__new__(VllmEngine)
    eng.cfg = cfg
    eng._init_sleep(cfg, on_cpu=False)
    eng.engine = _Recorder()

    async def stream(prompt_ids, params, version, samples):
        eng.engine.calls.append(("generate", eng.asleep))
        for s in samples:
            s.token_ids, s.logprobs, s.versions, s.finish_reason = [1], [-0.1], [version()], "stop"

    eng._stream = stream
    eng.sampling_params = lambda n, temperature=None, max_tokens=None: None
    return eng, eng.engine


def test_auto_sleeps_only_once_the_learner_is_known_to_share_the_gpu():
    eng, rec = _engine()  # generator.sleep=auto

    async def scenario():
        await eng.idle()
        assert rec.calls == [] and not eng.asleep  # no push over ipc from this GPU yet
        eng.shares_gpu = True
        await eng.idle()
        await eng.idle()  # already asleep: nothing more
        assert rec.calls == [("sleep", 1)] and eng.asleep
        out = await eng.generate_group([5, 6], 2, lambda: 3)
        assert [s.versions for s in out] == [[3], [3]]
        # Woken before the request, and awake while it ran.
        assert rec.calls == [("sleep", 1), ("wake_up", None), ("generate", False)]
        assert eng.num_sleeps == 1 and not eng.asleep

    asyncio.run(scenario())


def test_a_group_that_arrives_while_the_engine_falls_asleep_waits_and_wakes_it():
    eng, rec = _engine("generator.sleep=on", "generator.sleep_level=2")

    async def scenario():
        falling = asyncio.create_task(eng.idle())
        await asyncio.sleep(0.01)  # inside the engine's sleep call
        out = await eng.generate_group([1], 1, lambda: 0)
        await falling
        assert out[0].finish_reason == "stop"
        assert rec.calls == [("sleep", 2), ("wake_up", None), ("generate", False)]

    asyncio.run(scenario())


def test_no_sleep_while_a_group_is_running():
    eng, rec = _engine("generator.sleep=on")

    async def scenario():
        gate = asyncio.Event()

        async def slow_stream(prompt_ids, params, version, samples):
            await gate.wait()
            samples[0].finish_reason = "stop"

        eng._stream = slow_stream
        running = asyncio.create_task(eng.generate_group([1], 1, lambda: 0))
        await asyncio.sleep(0.01)
        await eng.idle()
        gate.set()
        await running
        assert rec.calls == [] and not eng.asleep
        await eng.idle()
        assert rec.calls == [("sleep", 1)]

    asyncio.run(scenario())


def test_a_weight_load_wakes_the_engine_and_no_idle_sleeps_it_before_the_load_is_done():
    import time

    from asyncrl.protocol import schema

    eng, rec = _engine()
    eng.weights_backend, eng.loaded_version = "ipc", None
    eng._resumed = asyncio.Event()

    async def no_pause(mode):
        rec.calls.append(("pause", mode))

    async def resume():
        rec.calls.append(("resume",))

    async def load(method, args=()):
        await eng.idle()  # the lease loop idles while the weights load: it must not sleep the engine
        rec.calls.append((method, eng.asleep))
        return [{"checksums": [7], "seconds": 0.01, "same_gpu": True}]

    eng._pause, rec.resume_generation, rec.collective_rpc = no_pause, resume, load
    ann = schema.encode(schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=2, epoch=1,
                                                  buckets=[], announced_at=time.time()))

    async def scenario():
        eng.shares_gpu = True
        await eng.idle()
        stats = await eng.update_weights(ann, "keep", 5.0)
        assert stats["checksums"] == [7] and stats["wake_s"] >= 0.0
        assert rec.calls == [("sleep", 1), ("wake_up", None), ("pause", "keep"), ("asyncrl_receive", False),
                             ("resume",)]
        assert eng.loaded_version == 2 and eng.shares_gpu and not eng.asleep
        await eng.idle()  # after the load the engine may sleep again
        assert rec.calls[-1] == ("sleep", 1)

    asyncio.run(scenario())


def test_off_and_async_mode_never_sleep():
    for overrides in (["generator.sleep=off"], ["run.mode=async", "generator.sleep=on"]):
        eng, rec = _engine(*overrides)
        eng.shares_gpu = True
        asyncio.run(eng.idle())
        assert rec.calls == [] and not eng.sleep_mode


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sync_run_on_one_gpu_sleeps_the_engine_between_batches(tmp_path, tiny_model):
    """`asyncrl run run.mode=sync` with the defaults on one GPU: weights.backend=auto picks ipc (the
    learner and the engine share the GPU), generator.sleep=auto then sleeps the engine between batches,
    and every step still trains with lag 0 on weights the engine verifiably holds."""
    steps = 4
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "run.mode=sync", f"run.max_steps={steps}",
                        f"run.dir={tmp_path / 'runs'}", f"model.path={tiny_model}", "algorithm.max_staleness=0",
                        "generator.gpu_memory_utilization=0.2", "logging.prometheus=false"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    logs = tmp_path / "runs" / "tiny" / "logs"
    learner = r.stdout + r.stderr  # `asyncrl run` leaves the learner on its own output
    generator = "".join(p.read_text() for p in logs.glob("generator-g*.log"))
    assert "backend=ipc" in learner, learner[-2000:]
    assert "engine asleep between batches (generator.sleep=auto, level 1)" in generator, generator[-3000:]
    wakes = [float(line.rsplit("wake ", 1)[1].split("s", 1)[0]) for line in generator.splitlines()
             if "now at version" in line and " wake " in line]
    # Every push woke the engine or found it awake (a tiny model's step can end before the engine
    # has idled); at least one push found it asleep.
    assert len(wakes) >= steps and any(w > 0 for w in wakes), wakes
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(row["lag_max"] == 0 for row in rows)
    assert rows[-1]["weights_mismatch"] == 0 and rows[-1]["weights_verified"] >= steps - 1
