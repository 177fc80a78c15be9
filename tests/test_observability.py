"""Observability parts on real Redis and real sockets, without a full run: the Prometheus exporter
scraped over HTTP and parsed, the watchdog's diagnoses, the step logger's backends read back."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.config import ConfigError, load_config
from asyncrl.observe.exporter import Exporter, all_metric_names
from asyncrl.observe.watchdog import Watchdog
from asyncrl.protocol.keys import Keys, connect, log_event
from asyncrl.protocol.store import ensure_groups

DOCS = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def scrape(url: str) -> dict:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_exported_metric_name_is_documented():
    docs = DOCS.read_text()
    missing = [n for n in all_metric_names() if f"`{n}`" not in docs]
    assert not missing, f"undocumented in docs/metrics.md: {missing}"


def test_logging_backends_are_type_checked():
    assert load_config(None, ["logging.backends=jsonl,tensorboard"]).logging.backends == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match=r"logging.backends\[0\]"):
        load_config(None, ["logging.backends=[wandbb]"])


def test_exporter_serves_parseable_metrics_with_histogram_and_labels():
    learner = Exporter("learner")
    gen = Exporter("generator", {"generator": "g7"})
    try:
        url = learner.serve("127.0.0.1", 0)
        learner.update({"step": 3, "version": 3, "lag_mean": 0.25, "lag_max": 1, "ess": 0.9, "tag": "x"})
        learner.observe_lags({"0": 6, "1": 2})
        learner.observe_lags({"1": 1, "5": 1})
        fams = scrape(url)
        assert fams["asyncrl_learner_version"].samples[0].value == 3
        assert fams["asyncrl_staleness_is_ess"].samples[0].value == 0.9
        buckets = {s.labels["le"]: s.value for s in fams["asyncrl_staleness_lag"].samples
                   if s.name.endswith("_bucket")}
        assert buckets["0"] == 6 and buckets["1"] == 9 and buckets["4"] == 9 and buckets["8"] == 10
        assert buckets["+Inf"] == 10
        gurl = gen.serve("127.0.0.1", 0)
        gen.update({"version": 2, "tokens": 40, "state": "waiting_weights"})
        g = scrape(gurl)
        assert g["asyncrl_generator_version"].samples[0].labels == {"generator": "g7"}
        assert [s.value for s in g["asyncrl_generator_tokens"].samples if s.name.endswith("_total")] == [40]
        states = {s.labels["state"]: s.value for s in g["asyncrl_generator_state"].samples}
        assert states["waiting_weights"] == 1 and states["generating"] == 0
    finally:
        learner.close()
        gen.close()


def test_exporter_fixed_port_falls_back_to_the_next_free_one():
    a, b = Exporter("buffer"), Exporter("buffer")
    try:
        a.serve("127.0.0.1", 0)
        port = int(a.url.rsplit(":", 1)[1].split("/")[0])
        b.serve("127.0.0.1", port)  # taken: the next one
        assert b.url != a.url and scrape(b.url) is not None
    finally:
        a.close()
        b.close()


def _cfg(redis, *extra):
    return load_config(None, [f"buffer.redis_url={redis.url}", "run.stall_timeout_s=5", *extra])


def test_watchdog_names_the_frozen_generator_and_why(redis_server):
    cfg = _cfg(redis_server)
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    now = time.time()
    client.hset(keys.gen("g0"), mapping={"id": "g0", "state": "generating", "version": 3, "pid": 4242,
                                         "updated_at": now - 2})
    client.hset(keys.gen("g1"), mapping={"id": "g1", "state": "generating", "version": 3, "pid": 4343,
                                         "updated_at": now - 30})
    wd = Watchdog(client, keys, cfg)
    stalls = wd.check(now)
    assert [(s.role, s.what) for s in stalls] == [("generator:g1", "heartbeat")]
    assert "4343" in stalls[0].reason and "frozen" in stalls[0].reason
    assert wd.check(now) == [], "a stall is reported once, not every check"
    # The key expires (TTL): still reported, as expired without a leave.
    client.delete(keys.gen("g1"))
    wd2 = Watchdog(client, keys, cfg)
    wd2.seen["g1"] = {"id": "g1", "updated_at": str(now - 30)}
    assert "expired" in wd2.check(now)[0].reason
    # A generator that left cleanly is not a stall.
    log_event(client, keys, "generator_leave", id="g1")
    assert wd2.evaluate(now) == []


def test_watchdog_learner_waiting_on_generators_waiting_on_weights(redis_server):
    cfg = _cfg(redis_server)
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    client.set(keys.version, 4)
    log_event(client, keys, "learner_start", version=0)
    client.xadd(keys.trajectories, {"data": b"x"}, id=f"{int((time.time() - 60) * 1000)}-0")
    client.xreadgroup("learner", "t", {keys.trajectories: ">"}, count=1)  # delivered: depth 0
    client.hset(keys.learner, mapping={"step": 4, "version": 4, "updated_at": time.time() - 60})
    wd = Watchdog(client, keys, cfg)
    client.hset(keys.gen("g0"), mapping={"id": "g0", "state": "generating", "version": 3,
                                         "updated_at": time.time()})
    wd.evaluate()  # g0 held a version: generation could start from here
    client.hset(keys.gen("g0"), mapping={"state": "waiting_weights", "version": -1})
    later = time.time() + 10
    client.hset(keys.gen("g0"), "updated_at", later)
    stalls = {(s.role, s.what): s for s in wd.evaluate(later)}
    assert ("generators", "no_trajectory") in stalls
    assert "waiting_weights" in stalls[("generators", "no_trajectory")].reason
    learner = stalls[("learner", "no_step")]
    assert "waiting for data" in learner.reason and "g0=waiting_weights" in learner.reason


def test_no_trajectory_names_the_generator_whose_heartbeat_is_gone_before_its_own_timeout(redis_server):
    # The last group came before the generator's last beat: the no-trajectory clock runs out first.
    # The stall must still name the generator, not only "generators", so a run ending on it says who.
    import socket

    cfg = _cfg(redis_server)
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    timeout = cfg.run.stall_timeout_s
    now = time.time()
    client.xadd(keys.trajectories, {"data": b"x"}, id=f"{int((now - timeout - 5) * 1000)}-0")
    client.xreadgroup("learner", "t", {keys.trajectories: ">"}, count=1)
    wd = Watchdog(client, keys, cfg)
    client.hset(keys.gen("g0"), mapping={"id": "g0", "state": "generating", "version": 1, "pid": 999999999,
                                         "host": socket.gethostname(), "updated_at": now - timeout - 6})
    wd.evaluate(now - timeout - 6)  # g0 seen holding a version
    client.delete(keys.gen("g0"))  # its key expired
    wd.seen["g0"]["updated_at"] = now - timeout + 3  # beat last 3 s inside the timeout
    stalls = {(s.role, s.what): s for s in wd.evaluate(now)}
    assert ("generators", "no_trajectory") in stalls
    named = stalls[("generator:g0", "heartbeat")]
    assert "expired" in named.reason and "no longer exists" in named.reason, named.reason


def test_metrics_logger_writes_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from asyncrl.observe.metrics import MetricsLogger

    cfg = load_config(None, [f"run.dir={tmp_path}", "logging.backends=[tensorboard]"])
    logger = MetricsLogger(cfg)
    for step in (1, 2, 3):
        logger.log(step, {"step": step, "lag_mean": 0.5 * step, "lag_hist": {"0": 4, "1": step}, "who": ["g0"]})
    logger.close()
    rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    acc = EventAccumulator(str(cfg.run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    assert [e.value for e in acc.Scalars("lag_mean")] == [0.5, 1.0, 1.5]
    assert [h.histogram_value.num for h in acc.Histograms("lag_hist")] == [5, 6, 7]


def test_readers_of_a_live_metrics_file_skip_the_row_being_written(tmp_path):
    from asyncrl.observe.ended import last_metrics_row
    from asyncrl.observe.metrics import JsonlBackend, complete_rows
    from asyncrl.observe.plot import load_rows

    path = tmp_path / "metrics.jsonl"
    assert complete_rows(path) == [] and last_metrics_row(tmp_path) is None
    backend = JsonlBackend(path)
    for step in (1, 2):
        backend.log(step, {"step": step, "loss": 0.1 * step})
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.3})[:9])  # the learner is half-way through row 3
    assert [r["step"] for r in complete_rows(path)] == [1, 2]
    assert [r["step"] for r in load_rows(tmp_path)] == [1, 2]
    assert last_metrics_row(tmp_path)["step"] == 2
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.3})[9:] + "\n")
    assert [r["step"] for r in complete_rows(path)] == [1, 2, 3]
    assert last_metrics_row(tmp_path)["step"] == 3


def test_watchdog_sees_the_learner_stuck_inside_a_weight_broadcast(redis_server):
    from asyncrl.protocol import schema

    cfg = _cfg(redis_server)
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    t = time.time() - 60
    client.xadd(keys.events, {"kind": "learner_start", "t": f"{t - 30:.3f}"})
    client.xadd(keys.trajectories, {"data": b"x"}, id=f"{int(t * 1000)}-0")
    client.hset(keys.learner, mapping={"step": 5, "version": 5, "updated_at": t})
    client.set(keys.version, 5)
    client.set(keys.wgroup, schema.encode(schema.GroupEpoch(schema_version=schema.SCHEMA_VERSION, epoch=2,
                                                            addr="127.0.0.1", port=1, members=["g0.0"],
                                                            backend="gloo", opened_at=t)))
    client.set(keys.wsync, schema.encode(schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=5,
                                                                   epoch=2, buckets=[], announced_at=t + 1)))
    (stall,) = [s for s in Watchdog(client, keys, cfg).evaluate() if s.role == "learner"]
    assert stall.what == "no_step" and "inside the weight broadcast of version 5" in stall.reason
    assert "g0.0" in stall.reason
    # Once the broadcast finished (its `sync` event), the same state is no longer "inside a broadcast".
    log_event(client, keys, "sync", version=5, epoch=2)
    (stall,) = [s for s in Watchdog(client, keys, cfg).evaluate() if s.role == "learner"]
    assert "inside the weight broadcast" not in stall.reason


def test_watchdog_names_the_generator_frozen_before_a_broadcast_not_the_learner_waiting_on_it(redis_server):
    """The learner stepped at t, its generator froze at t + 0.5 (last heartbeat), then the learner
    announced the next broadcast at t + 1 and waits for it. At t + timeout + 0.7 the generator's
    heartbeat is past the timeout and the learner's broadcast is not: the generator is the stall
    (the learner's clock inside a broadcast starts at the announcement, not at its last step)."""
    from asyncrl.protocol import schema

    cfg = _cfg(redis_server)  # stall_timeout_s=5
    client, keys = connect(redis_server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    t = time.time()
    client.xadd(keys.events, {"kind": "learner_start", "t": f"{t - 30:.3f}"})
    client.xadd(keys.trajectories, {"data": b"x"}, id=f"{int((t - 10) * 1000)}-0")
    client.hset(keys.learner, mapping={"step": 1, "version": 1, "updated_at": t})
    client.set(keys.version, 1)
    client.hset(keys.gen("g0"), mapping={"id": "g0", "state": "generating", "version": 1, "pid": 4242,
                                         "updated_at": t + 0.5})
    client.set(keys.wgroup, schema.encode(schema.GroupEpoch(schema_version=schema.SCHEMA_VERSION, epoch=1,
                                                            addr="127.0.0.1", port=1, members=["g0.0"],
                                                            backend="gloo", opened_at=t - 20)))
    client.set(keys.wsync, schema.encode(schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=2,
                                                                   epoch=1, buckets=[], announced_at=t + 1)))
    wd = Watchdog(client, keys, cfg)
    stalls = {(s.role, s.what) for s in wd.evaluate(t + 5.7)}
    assert ("generator:g0", "heartbeat") in stalls and ("learner", "no_step") not in stalls, stalls
    # Still inside that broadcast past the timeout from its announcement: the learner is named too.
    assert ("learner", "no_step") in {(s.role, s.what) for s in wd.evaluate(t + 6.2)}


def test_launcher_watchdog_rides_out_a_redis_outage(tmp_path):
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.observe.watchdog import LauncherWatchdog

    server = LocalRedis(tmp_path / "r").start()
    cfg = _cfg(server)
    client, keys = connect(server.url), Keys(cfg.run.name)
    ensure_groups(client, keys)
    client.hset(keys.gen("g0"), mapping={"id": "g0", "state": "generating", "version": 0,
                                         "updated_at": time.time() - 60})
    wd = LauncherWatchdog(cfg, keys, ("g0",))
    (stall,) = wd.poll()
    assert stall.role == "generator:g0"
    events = [f for _i, f in client.xrange(keys.events) if f[b"kind"] == b"stall"]
    assert events and events[0][b"role"] == b"generator:g0"
    server.stop()
    wd._next = 0.0
    assert wd.poll() == [] and wd._redis_down


def test_process_state_tells_a_stopped_process_from_a_gone_one():
    import signal
    import socket
    import subprocess

    from asyncrl.observe.watchdog import process_state

    child = subprocess.Popen(["sleep", "30"])
    try:
        info = {"pid": str(child.pid), "host": socket.gethostname()}
        assert "stopped" not in process_state(info)
        child.send_signal(signal.SIGSTOP)
        deadline = time.time() + 10  # the state flips when the kernel next handles the child (loaded CI)
        while not process_state(info).endswith("is stopped (SIGSTOP)") and time.time() < deadline:
            time.sleep(0.05)
        assert process_state(info).endswith("is stopped (SIGSTOP)"), process_state(info)
        assert process_state({**info, "host": "elsewhere"}) == ""
    finally:
        child.kill()
        child.wait()
    assert "no longer exists" in process_state(info)


def test_status_at_80_columns_wraps_its_rows_and_cuts_no_word():
    from rich.console import Console

    from asyncrl.observe.status import render

    snap = {"num_generators": 1, "run": "tiny", "stopped": False, "stalls": [], "events": [], "members": [],
            "generators": [{"id": "g0", "state": "generating", "version": 3, "tokens_per_s": 10.0,
                            "idle_ratio": 0.1, "groups": 4, "heartbeat_age_s": 0.5}],
            "learner": {"step": 3, "version": 3, "tokens_per_s": 100.0, "idle_ratio": 0.2, "dropped_groups": 0,
                        "quarantined": 0, "updated_age_s": 0.3, "staleness_bound": 1, "compute_s": 0.1,
                        "data_wait_s": 0.2, "sync_s": 0.01, "push_wait_s": 0.0, "mfu": 0.05},
            "buffer": {"depth": 2, "oldest_age_s": 1.0, "groups_per_s": 2.0, "prompt_backlog": 5, "released": 10,
                       "updated_age_s": 0.2, "rejected": {}},
            "lag": {"batches": 1, "hist": {"1": 10}}}
    console = Console(width=80, record=True)
    console.print(render(snap))
    text = console.export_text()
    assert "…" not in text
    for word in ("learner", "quarantined", "staleness", "waiting", "backlog", "mfu"):
        assert word in text, word
