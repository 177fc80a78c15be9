"""Observability of real runs (`asyncrl run`: redis-server, buffer, vLLM generators, torchrun learner).

One run checks, while it goes: every role's /metrics endpoint scraped and parsed, `status --once
--json`, `inspect --json`; after it: wandb offline files and TensorBoard event files read back, and
`asyncrl plot` PNGs. A second run freezes a generator with SIGSTOP and expects the watchdog to name
it within `run.stall_timeout_s` and, with `run.on_stall=fail`, the launcher to exit non-zero.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.config import load_config
from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol.keys import Keys, connect

STALENESS_KEYS = ("lag_mean", "lag_max", "sample_age_s", "is_weight_mean", "is_weight_max", "ess", "clip_frac",
                  "is_capped_frac", "masked_frac", "dropped_frac", "sync_s", "idle_ratio")


def _wait(cond, timeout_s: float, what: str, proc=None, log=None):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the run exited ({proc.returncode}) while waiting for {what}:\n{_tail(log)}")
        try:
            value = cond()
        except redis.exceptions.ConnectionError:  # the run's Redis went down with it: the check above says why
            value = None
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s}s waiting for {what}:\n{_tail(log)}")


def _tail(path, n=4000):
    return Path(path).read_text()[-n:] if path and Path(path).exists() else ""


def _rows(run_dir):
    return complete_rows(run_dir / "metrics.jsonl")


def _client(run_dir):
    """The launcher writes the resolved config (with its redis-server's URL) into the run dir."""
    cfg = load_config(run_dir / "config.yaml")
    return connect(cfg.buffer.redis_url, retry_s=5.0), Keys(cfg.run.name)  # the run's Redis dies with the run


def _scrape(url):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams, name):
    return fams[name].samples[0].value


def wandb_history(run_dir: Path) -> list[dict]:
    """History rows of the offline run, read from its .wandb file (a LevelDB-style record log of
    protobuf `Record`s, 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): i.value_json for i in rec.history.item})
    return rows


@pytest.mark.slow
def test_observed_run_metrics_endpoints_status_wandb_tensorboard_plot(tmp_path, tiny_model):
    # Long enough for every check below on a slow machine; ended with stop_request once they are done.
    steps = 1000
    run_dir = tmp_path / "runs" / "obs"
    log = tmp_path / "launcher.log"
    argv = [sys.executable, "-m", "asyncrl", "run", f"run.dir={tmp_path / 'runs'}", "run.name=obs",
            f"run.max_steps={steps}", f"model.path={tiny_model}", "generator.num_generators=2",
            "generator.kv_cache_gb=0.5", "logging.backends=[jsonl,wandb,tensorboard]", "checkpoint.every=1000"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: (run_dir / "config.yaml").exists(), 120, "the run's config.yaml", proc, log)
        client, keys = _client(run_dir)
        roles = ("buffer", "learner", "generator:g0", "generator:g1")
        urls = _wait(lambda: (h := {k.decode(): v.decode() for k, v in client.hgetall(keys.exporters).items()})
                     and all(r in h for r in roles) and h, 600, "all four /metrics endpoints", proc, log)
        _wait(lambda: len(_rows(run_dir)) >= 2, 600, "two learner steps", proc, log)

        # ---- /metrics of every role, scraped during the run and parsed ----
        for url in urls.values():
            assert url.startswith("http://127.0.0.1:"), url  # bound to localhost by default
        learner = _scrape(urls["learner"])
        version_now = int(client.get(keys.version))
        assert 2 <= _value(learner, "asyncrl_learner_version") <= version_now
        for name in ("asyncrl_staleness_lag_mean", "asyncrl_staleness_lag_max", "asyncrl_staleness_sample_age_seconds",
                     "asyncrl_staleness_is_weight_mean", "asyncrl_staleness_is_weight_max", "asyncrl_staleness_is_ess",
                     "asyncrl_staleness_clipped_fraction", "asyncrl_staleness_truncated_fraction",
                     "asyncrl_staleness_masked_fraction", "asyncrl_staleness_dropped_fraction",
                     "asyncrl_learner_sync_seconds", "asyncrl_learner_idle_ratio"):
            assert name in learner, f"{name} missing from the learner's /metrics"
        assert _value(learner, "asyncrl_staleness_lag_max") <= 1  # tiny.yaml: max_staleness=1
        assert 0 < _value(learner, "asyncrl_staleness_is_ess") <= 1
        assert _value(learner, "asyncrl_learner_sync_seconds") > 0
        lag = {s.labels["le"]: s.value for s in learner["asyncrl_staleness_lag"].samples if s.name.endswith("_bucket")}
        assert lag["+Inf"] > 0 and lag["1"] == lag["+Inf"], lag
        # The buffer's counters are sampled periodically, so a scrape right after the second step can
        # still show an earlier count: wait for the sample that has a batch in it.
        def buffer_stored_a_batch():
            fams = _scrape(urls["buffer"])
            groups = [s.value for s in fams["asyncrl_buffer_groups"].samples if s.name.endswith("_total")]
            return fams if groups and groups[0] >= 8 else None

        buffer = _wait(buffer_stored_a_batch, 60, "the buffer's /metrics to count a batch of groups", proc, log)
        assert "asyncrl_buffer_depth" in buffer and "asyncrl_buffer_oldest_age_seconds" in buffer
        for gid in ("g0", "g1"):
            gen = _scrape(urls[f"generator:{gid}"])
            assert gen["asyncrl_generator_version"].samples[0].labels == {"generator": gid}
            assert _value(gen, "asyncrl_generator_version") >= 0
            assert "asyncrl_generator_idle_ratio" in gen and "asyncrl_generator_sync_seconds" in gen
        tokens = sum(s.value for gid in ("g0", "g1") for s in _scrape(urls[f"generator:{gid}"])
                     ["asyncrl_generator_tokens"].samples if s.name.endswith("_total"))
        assert tokens > 0

        # ---- status --once --json during the run ----
        before = int(client.get(keys.version))
        r = subprocess.run([sys.executable, "-m", "asyncrl", "status", str(run_dir / "config.yaml"), "--once", "--json"],
                           capture_output=True, text=True, timeout=60)
        after = int(client.get(keys.version))
        assert r.returncode == 0, r.stderr[-2000:]
        snap = json.loads(r.stdout)
        assert snap["num_generators"] == 2
        assert sorted(g["id"] for g in snap["generators"]) == ["g0", "g1"]
        assert before <= snap["learner"]["version"] <= after
        assert snap["lag"]["batches"] >= 2 and snap["lag"]["hist"]
        assert {e["kind"] for e in snap["events"]} & {"sync", "generator_join", "learner_start"}
        assert snap["learner"]["metrics_url"] == urls["learner"]

        # ---- inspect: newest trajectories, decoded, behaviour vs current log-probs ----
        r = subprocess.run([sys.executable, "-m", "asyncrl", "inspect", str(run_dir / "config.yaml"), "-n", "1",
                            "--samples", "1", "--json"], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        dump = json.loads(r.stdout)
        (group,) = dump["groups"]
        (sample,) = group["samples"]
        assert sample["tokens"] and isinstance(sample["text"], str)
        for t in sample["tokens"]:
            assert t["version"] >= 0 and t["behaviour_logprob"] <= 1e-4 and t["current_logprob"] <= 1e-4
        r = subprocess.run([sys.executable, "-m", "asyncrl", "inspect", str(run_dir / "config.yaml"), "-n", "1",
                            "--samples", "1", "--no-current"], capture_output=True, text=True, timeout=180)
        assert r.returncode == 0 and "behaviour lp" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]

        client.set(keys.stop_request, 1)  # the learner ends the run as if at max_steps
        assert proc.wait(timeout=600) == 0, _tail(log)
        steps = len(_rows(run_dir))
        assert steps >= 2
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # Stopped between checkpoints (every 1000 steps): the stop itself saved the last step.
    (ckpt,) = [p for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()]
    assert json.loads((ckpt / "meta.json").read_text())["step"] == steps, ckpt
    assert any(k.startswith("gen/g1/") for k in rows[-1]), "the fleet's metrics are in the step log"

    # ---- TensorBoard event files, read back ----
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in (*STALENESS_KEYS, "gen/g0/tokens_per_s", "buffer/depth", "reward_mean"):
        assert key in tags, f"{key} not in TensorBoard scalars"
    assert [e.step for e in acc.Scalars("lag_mean")] == list(range(1, steps + 1))
    assert [e.value for e in acc.Scalars("version")] == [float(r["version"]) for r in rows]
    assert len(acc.Histograms("lag_hist")) == steps

    # ---- wandb offline files, read back ----
    history = wandb_history(run_dir)
    assert len(history) == steps
    for key in (*STALENESS_KEYS, "gen/g0/tokens_per_s"):
        assert key in history[-1], f"{key} not in the wandb history"
    assert [json.loads(h["lag_mean"]) for h in history] == pytest.approx([r["lag_mean"] for r in rows])
    assert "lag_hist/values" in history[-1] or "lag_hist" in history[-1]

    # ---- plot from the run's directory ----
    r = subprocess.run([sys.executable, "-m", "asyncrl", "plot", str(run_dir)], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    pngs = sorted(Path(p).name for p in r.stdout.split())
    for name in ("reward.png", "reward_distribution.png", "lag.png", "throughput.png", "sync.png"):
        assert name in pngs
    import matplotlib.image

    for name in pngs:
        path = run_dir / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
        assert matplotlib.image.imread(path).std() > 0.01, f"{name} is blank"


@pytest.mark.slow
def test_frozen_generator_is_reported_as_stalled_and_fails_the_run(tmp_path, tiny_model):
    timeout_s = 20.0
    run_dir = tmp_path / "runs" / "stall"
    log = tmp_path / "launcher.log"
    argv = [sys.executable, "-m", "asyncrl", "run", f"run.dir={tmp_path / 'runs'}", "run.name=stall",
            "run.max_steps=1000", f"model.path={tiny_model}", f"run.stall_timeout_s={timeout_s}",
            "run.on_stall=fail", "logging.prometheus=false"]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    pid = None
    try:
        _wait(lambda: len(_rows(run_dir)) >= 1, 600, "the first learner step", proc, log)
        client, keys = _client(run_dir)
        pid = int(client.hget(keys.gen("g0"), "pid"))
        os.kill(pid, signal.SIGSTOP)
        frozen_at = time.time()

        def stall_event():
            for _id, f in client.xrange(keys.events):
                if f[b"kind"] == b"stall" and f[b"role"] == b"generator:g0":
                    return {k.decode(): v.decode() for k, v in f.items()}
            return None

        event = _wait(stall_event, timeout_s + 30, "a stall event naming generator:g0", proc, log)
        detected_s = time.time() - frozen_at
        os.kill(pid, signal.SIGCONT)  # let teardown be quick
        assert event["what"] == "heartbeat" and "frozen" in event["reason"], event
        assert f"process {pid} on this host is stopped (SIGSTOP)" in event["reason"], event
        # The heartbeat is checked every second, beats every heartbeat_s (1 s): a few seconds of slack.
        assert detected_s <= timeout_s + 5, f"reported after {detected_s:.1f}s (stall_timeout_s={timeout_s})"
        assert proc.wait(timeout=120) == 3, _tail(log)
        text = log.read_text()
        assert "STALL generator:g0: heartbeat" in text
        assert "run.on_stall=fail" in text
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
