"""A real `asyncrl generator` process (vLLM CPU build) next to a real buffer process, with the test as
the learner: a mismatching generator refuses to start; a generator started late holds no weights and
generates nothing until it has received the current version; SIGTERM drains, hands back what it could
not finish, and leaves cleanly; SIGTERM during the engine's start-up ends it at once, cleanly."""

import json
import signal
import sys
import threading
import time

import pytest
import torch

from asyncrl.config import dump_yaml
from asyncrl.protocol import sampling, schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, connect
from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets
from tests.buffer_support import BufferProcess, wait_for
from tests.gen_support import perturbed_state
from tests.helpers import Procs


def _gen_info(client, keys, gid):
    return {k.decode(): v.decode() for k, v in client.hgetall(keys.gen(gid)).items()}


def _push_v1(client, keys, sd, member="g0.0"):
    """What learner rank 0 does for a late joiner: open an epoch with it, announce, broadcast."""
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=120, sync_timeout_s=120)
    members = sender.open_epoch([member], lambda info: client.set(keys.wgroup, schema.encode(info)),
                                lambda *a, **k: None)
    assert members == [member]
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], 256 * 1024)
    ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=1, epoch=sender.epoch,
                                    buckets=buckets, announced_at=time.time())
    client.set(keys.wsync, schema.encode(ann))
    return sender.broadcast(buckets, pack_buckets(buckets, iter(sd.items()), torch.device("cpu")))


def _learner_side(make_cfg, redis_server, tmp_path, name, *overrides):
    """Config file, Redis state and a real buffer process as a learner at version 1 leaves them (its
    sampling settings published); the test plays the learner from there."""
    cfg = make_cfg(f"run.name={name}", "learner.batch_groups=16", "logging.prometheus=false", *overrides,
                   redis=redis_server)
    cfg_path = tmp_path / f"{name}.yaml"
    cfg_path.write_text(dump_yaml(cfg))
    keys = Keys(cfg.run.name)
    client = connect(redis_server.url)
    client.set(keys.version, 1)
    sampling.publish(client, keys, cfg.generator)
    return cfg_path, keys, client, BufferProcess(cfg, tmp_path).start(client, keys), Procs(tmp_path)


@pytest.mark.slow
def test_generator_refusal_late_join_and_sigterm_drain(make_cfg, redis_server, tmp_path, tiny_model):
    cfg_path, keys, client, buffer, procs = _learner_side(
        make_cfg, redis_server, tmp_path, "gp", "generator.max_tokens=64", "generator.max_concurrent_groups=4",
        "generator.drain_timeout_s=0", "learner.batch_groups=64")  # groups still in flight at the SIGTERM
    client.set(keys.wsync, schema.encode(schema.WeightAnnouncement(
        schema_version=schema.SCHEMA_VERSION, version=1, epoch=0, buckets=[], announced_at=time.time())))
    argv = [sys.executable, "-m", "asyncrl", "generator", str(cfg_path)]
    try:
        # A generator with another temperature refuses to start, with the reason, before loading vLLM.
        bad = procs.spawn("g-bad", argv + ["generator.temperature=0.5", "--id", "gbad"])
        assert bad.wait(timeout=120) != 0
        assert "refuses to start" in procs.log("g-bad") and "generator.temperature=1.0" in procs.log("g-bad")
        assert not client.exists(keys.gen("gbad"))

        # SIGTERM while its engine starts: it leaves at once and cleanly, having never joined the fleet.
        early = procs.spawn("g-early", argv + ["--id", "gearly"])
        assert wait_for(lambda: client.hexists(keys.timeline, "gearly engine start"), 120, 0.05), \
            procs.log("g-early")[-3000:]
        early.send_signal(signal.SIGTERM)
        assert early.wait(timeout=30) == 0, procs.log("g-early")[-3000:]
        assert "SIGTERM during start-up: left before joining the fleet" in procs.log("g-early")
        assert not client.exists(keys.gen("gearly"))

        g0 = procs.spawn("g0", argv + ["--id", "g0"])
        assert wait_for(lambda: _gen_info(client, keys, "g0").get("state") == "waiting_weights", 180, 0.2), \
            procs.log("g0")[-3000:]
        assert client.xlen(keys.prompts) > 0  # prompts are there ...
        time.sleep(3)
        info = _gen_info(client, keys, "g0")  # ... but a generator without the current weights takes none
        assert info["version"] == "-1" and info["tokens"] == "0" and client.xlen(keys.trajectories) == 0
        assert json.loads(client.get(keys.sampling)) == {k: float(info[f"sampling_{k}"]) for k in sampling.FIELDS}

        sums = {}
        pusher = threading.Thread(target=lambda: sums.setdefault("v1", _push_v1(client, keys, perturbed_state(
            tiny_model, 1))), daemon=True)
        pusher.start()
        pusher.join(180)
        assert "v1" in sums, procs.log("g0")[-3000:]
        assert wait_for(lambda: _gen_info(client, keys, "g0").get("version") == "1", 60, 0.1)
        assert _gen_info(client, keys, "g0")["checksums"] == ",".join(map(str, sums["v1"]))
        assert wait_for(lambda: client.xlen(keys.trajectories) >= 2, 180, 0.1), procs.log("g0")[-3000:]
        assert float(_gen_info(client, keys, "g0")["last_pause_s"]) > 0

        # SIGTERM mid-generation: no new leases; unfinished groups' prompts are handed back at once.
        g0.send_signal(signal.SIGTERM)
        assert g0.wait(timeout=120) == 0, procs.log("g0")[-3000:]
        assert not client.exists(keys.gen("g0"))
        events = [f[b"kind"].decode() for _, f in client.xrange(keys.events)]
        assert "generator_leave" in events and "hand_back" in events
        handed = [int(f[b"num"]) for _, f in client.xrange(keys.events) if f[b"kind"] == b"hand_back"]
        assert handed and handed[0] >= 1
        pending = client.xpending_range(keys.prompts, PROMPT_GROUP, min="-", max="+", count=1000, consumername="g0")
        assert pending == [], "the generator left holding leases"
        for _, fields in client.xrange(keys.trajectories):
            group = schema.decode(fields[b"data"], schema.TrajectoryGroup)
            assert group.generator_id == "g0" and group.min_version() == 1  # every token under the pushed weights
    finally:
        procs.close()
        buffer.stop()


@pytest.mark.slow
def test_generator_leaves_at_once_when_the_run_is_over(make_cfg, redis_server, tmp_path, tiny_model):
    """The learner set `stop` (the run is over) and the buffer left with it, so the generator holds
    groups nobody will confirm: it must leave at once (exit 0), not wait up to 60 s for ingest
    confirmations, which outlasted the launcher's 20 s grace (it was then killed)."""
    from asyncrl.launch.launcher import GRACE_S

    cfg_path, keys, client, buffer, procs = _learner_side(
        make_cfg, redis_server, tmp_path, "over", "generator.backend=hf", "generator.max_tokens=8",
        "generator.max_concurrent_groups=2")
    try:
        g1 = procs.spawn("g1", [sys.executable, "-m", "asyncrl", "generator", str(cfg_path), "--id", "g1"])
        assert wait_for(lambda: _gen_info(client, keys, "g1").get("state") == "waiting_weights", 180, 0.2), \
            procs.log("g1")[-3000:]
        _push_v1(client, keys, perturbed_state(tiny_model, 1), member="g1.0")
        assert wait_for(lambda: client.xlen(keys.trajectories) >= 1, 120, 0.1), procs.log("g1")[-3000:]
        buffer.kill()  # gone, as at the end of a run: what the generator pushes now stays unconfirmed
        groups = int(_gen_info(client, keys, "g1")["groups"])
        assert wait_for(lambda: int(_gen_info(client, keys, "g1")["groups"]) >= groups + 2, 120, 0.1), \
            procs.log("g1")[-3000:]
        t0 = time.monotonic()
        client.set(keys.stop, "1")  # what the learner does when it has finished
        assert g1.wait(timeout=60) == 0, procs.log("g1")[-3000:]
        took = time.monotonic() - t0
        assert took < GRACE_S / 2, (took, procs.log("g1")[-3000:])
        assert "the run is over" in procs.log("g1") and not client.exists(keys.gen("g1"))
    finally:
        procs.close()
        buffer.stop()
