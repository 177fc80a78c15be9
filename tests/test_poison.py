"""Semantic poison (groups that pass the wire checks but are bad for this run) can neither be stored
nor stop training: the buffer refuses it with a counted reason, and a learner that meets it anyway
(written straight into Redis, or left pending by a crash) quarantines it and finishes the run."""

from __future__ import annotations

import logging
import subprocess
import sys

import msgspec
import pytest

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups
from tests.buffer_support import push, start_thread, wait_for
from tests.helpers import fixed_groups, make_group

VOCAB = 128  # the tiny model's


def _poison(group_id: str) -> dict[str, schema.TrajectoryGroup]:
    """One group per way of being bad for the run while passing schema.decode."""
    out = {}
    g = make_group(group_id)
    g.samples[0].completion_ids = schema.pack_i32([5, 262149, 6])  # a bit-flipped token id
    out["token_id"] = g
    g = make_group(group_id)
    g.sampling = schema.SamplingInfo(0.7, 1.0, -1)
    out["sampling_mismatch"] = g
    g = make_group(group_id)
    g.prompt_id = "someone-else"
    out["bad_group_id"] = g
    g = make_group(group_id, num_tokens=9)  # generator.max_tokens is 8
    out["too_long"] = g
    return out


def test_buffer_refuses_semantic_poison_with_a_counted_reason_and_logs_once_per_reason(make_cfg, redis_server,
                                                                                       caplog):
    cfg = make_cfg("run.name=poison", "learner.batch_groups=2", redis=redis_server)
    svc, t = start_thread(cfg)
    try:
        assert wait_for(lambda: svc.client.xlen(svc.keys.prompts) > 0)
        released = [schema.decode(f[b"data"], schema.PromptTask) for _, f in svc.client.xrange(svc.keys.prompts)]
        gid = released[0].group_id
        later = schema.split_group_id(released[0].group_id)[0] + "@e5"  # a later epoch: never released
        frames = [schema.encode(g) for g in _poison(gid).values()]
        frames += [schema.encode(make_group(later)), schema.encode(make_group("not-a-prompt@e0"))]
        g = make_group(gid)
        g.samples[1].completion_ids = schema.pack_i32([1, 2, 33554437])
        frames += [schema.encode(g)] * 20  # a burst of one reason
        with caplog.at_level(logging.WARNING, logger="buffers.service"):
            push(svc.ingest_addr, frames + [schema.encode(make_group(gid))])
            assert wait_for(lambda: svc.counters.get("frames", 0) == len(frames) + 1)
        rejects = {k[7:]: v for k, v in svc.counters.items() if k.startswith("reject:")}
        assert rejects == {"token_id": 21, "sampling_mismatch": 1, "bad_group_id": 1, "too_long": 1,
                           "unreleased_id": 1, "unknown_prompt": 1}, rejects
        stored = [schema.decode(f[b"data"], schema.TrajectoryGroup) for _, f in svc.client.xrange(svc.keys.trajectories)]
        assert [s.group_id for s in stored] == [gid]  # only the good one
        token_lines = [r for r in caplog.records if "token_id" in r.getMessage()]
        assert len(token_lines) == 1, [r.getMessage() for r in token_lines]  # 21 rejects, one line
        svc.publish_metrics()
        assert int(svc.client.hget(svc.keys.metrics, "buffer:reject:token_id")) == 21
    finally:
        svc.stop()
        t.join(10)


def _rows(cfg):
    return complete_rows(cfg.run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_learner_quarantines_poison_on_the_fresh_and_the_recovery_path_and_finishes(tmp_path, tiny_model):
    """Poison written straight into the trajectories stream (no buffer to refuse it), some of it
    already delivered to the learner's consumer and never acked, as a crashed learner leaves it."""
    steps, groups = 2, 2
    with LocalRedis(tmp_path / "redis") as redis:
        cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", "run.name=pq", f"run.max_steps={steps}",
                                 f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                                 f"learner.batch_groups={groups}", "algorithm.max_staleness=1000",
                                 "checkpoint.export_hf=false", "run.stall_timeout_s=0"])
        path = tmp_path / "pq.yaml"
        path.write_text(dump_yaml(cfg))
        client, keys = connect(redis.url), Keys("pq")
        ensure_groups(client, keys)
        poison = _poison("p90@e0")
        pending = ["token_id", "sampling_mismatch"]  # the recovery path meets these
        for reason in pending:
            client.xadd(keys.trajectories, {"data": schema.encode(poison[reason])})
        client.xadd(keys.trajectories, {"data": b"\x93\x01\x02"})  # does not decode as a group
        client.xreadgroup(LEARNER_GROUP, "learner-0", {keys.trajectories: ">"}, count=10)  # delivered, unacked
        for reason in ("bad_group_id", "too_long"):  # the fresh path meets these
            client.xadd(keys.trajectories, {"data": schema.encode(poison[reason])})
        for g in fixed_groups(steps * groups):
            client.xadd(keys.trajectories, {"data": schema.encode(g)})
        with open(tmp_path / "learner.log", "w") as log:
            proc = subprocess.run([sys.executable, "-m", "asyncrl", "learner", str(path)], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=600)
        text = (tmp_path / "learner.log").read_text()
        assert proc.returncode == 0, text[-3000:]
        rows = _rows(cfg)
        assert [r["step"] for r in rows] == [1, 2]
        assert rows[-1]["quarantined"] == 5 and rows[-1]["num_groups"] == groups
        dead = client.xrange(keys.quarantine)
        reasons = sorted(f[b"reason"].decode() for _, f in dead)
        assert reasons == sorted(["token_id", "sampling_mismatch", "schema", "bad_group_id", "too_long"]), reasons
        assert all(msgspec.msgpack.decode(f[b"data"]) for _, f in dead if f[b"reason"] != b"schema")
        assert int(client.hget(keys.learner, "quarantined")) == 5
        assert int(client.xpending(keys.trajectories, LEARNER_GROUP)["pending"]) == 0  # all acked
        kinds = [f[b"kind"] for _, f in client.xrange(keys.events)]
        assert kinds.count(b"quarantine") == 5
        assert "Traceback" not in text
        from asyncrl.observe.status import snapshot

        assert snapshot(client, keys, cfg)["learner"]["quarantined"] == 5
