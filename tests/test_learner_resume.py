"""kill -9 the learner mid-run, restart it: it resumes the latest complete DCP checkpoint, re-trains
exactly the trajectories that were delivered but not yet covered by a checkpoint, and its loss
curve continues that of an uninterrupted run on the same data."""

import json
import signal
import subprocess
import sys
import time

import pytest

from asyncrl.config import dump_yaml, load_config
from asyncrl.launch.launcher import kill_tree
from asyncrl.launch.redis_server import LocalRedis
from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, connect
from asyncrl.protocol.store import LEARNER_GROUP, ensure_groups
from tests.helpers import fixed_groups

STEPS, GROUPS = 6, 4


def _groups():
    return fixed_groups(STEPS * GROUPS)


def _setup(tmp_path, name, tiny_model, num_groups=STEPS * GROUPS):
    redis = LocalRedis(tmp_path / f"redis-{name}").start()
    cfg = load_config(None, [f"run.dir={tmp_path / 'runs'}", f"run.name={name}", f"run.max_steps={STEPS}",
                             f"model.path={tiny_model}", f"buffer.redis_url={redis.url}",
                             f"learner.batch_groups={GROUPS}", "algorithm.max_staleness=1000",
                             "checkpoint.every=2", "learner.lr=1e-3"])
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_yaml(cfg))
    client = connect(redis.url)
    keys = Keys(name)
    ensure_groups(client, keys)
    for g in _groups()[:num_groups]:
        client.xadd(keys.trajectories, {"data": schema.encode(g)})
    return redis, cfg, path, client, keys


def _learner(path, log):
    return subprocess.Popen([sys.executable, "-m", "asyncrl", "learner", str(path)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _rows(cfg):
    return complete_rows(cfg.run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_kill_9_and_resume_continues_the_same_curve(tmp_path, tiny_model):
    redis_a, cfg_a, path_a, client_a, keys_a = _setup(tmp_path, "straight", tiny_model)
    # The crashed run first gets data for 3 steps only, so it is killed while waiting for more.
    redis_b, cfg_b, path_b, client_b, keys_b = _setup(tmp_path, "crashed", tiny_model, num_groups=3 * GROUPS)
    try:
        with open(tmp_path / "a.log", "w") as log:
            assert _learner(path_a, log).wait(timeout=600) == 0, (tmp_path / "a.log").read_text()[-3000:]
        want = {r["step"]: r["loss"] for r in _rows(cfg_a)}
        assert sorted(want) == list(range(1, STEPS + 1))

        with open(tmp_path / "b1.log", "w") as log:
            p = _learner(path_b, log)
            deadline = time.time() + 600
            while len(_rows(cfg_b)) < 3 and time.time() < deadline:
                assert p.poll() is None, (tmp_path / "b1.log").read_text()[-3000:]
                time.sleep(0.05)
            time.sleep(1.0)
            kill_tree(p.pid, signal.SIGKILL)  # the whole learner: torchrun and its rank
            p.wait()
        killed_at = max(r["step"] for r in _rows(cfg_b))
        assert killed_at == 3
        for g in _groups()[3 * GROUPS:]:
            client_b.xadd(keys_b.trajectories, {"data": schema.encode(g)})
        # Steps 3.. were never checkpointed: their groups are still pending, not acked.
        assert int(client_b.xpending(keys_b.trajectories, LEARNER_GROUP)["pending"]) >= GROUPS
        # The checkpoint names the entries it made durable (a resume acks them again: tests/test_checkpoint_acks.py).
        meta = json.loads((cfg_b.checkpoint_dir / "step-000002" / "meta.json").read_text())
        assert len(meta["acked_entries"]) == 2 * GROUPS

        with open(tmp_path / "b2.log", "w") as log:
            assert _learner(path_b, log).wait(timeout=600) == 0, (tmp_path / "b2.log").read_text()[-3000:]
        text = (tmp_path / "b2.log").read_text()
        assert "resumed from" in text and "step-000002" in text
        rows = _rows(cfg_b)
        # One row per step: the re-trained step 3 replaced the killed learner's, which is kept aside.
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), [r["step"] for r in rows]
        rolled_back = complete_rows(cfg_b.run_dir / "metrics.rolled_back.jsonl")
        assert [r["step"] for r in rolled_back] == [killed_at]
        resumed = rows[killed_at - 1:]
        assert [r["step"] for r in resumed] == list(range(3, STEPS + 1)), "resume continues at step 3"
        assert [r["version"] for r in resumed] == list(range(3, STEPS + 1))
        for r in resumed:
            assert abs(r["loss"] - want[r["step"]]) < 1e-4 * max(1.0, abs(want[r["step"]])), (r["step"], r["loss"], want)
        # Exactly once into the persisted model: every group acked, none left pending.
        assert int(client_b.xpending(keys_b.trajectories, LEARNER_GROUP)["pending"]) == 0
        assert int(client_b.get(keys_b.version)) == STEPS

        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(cfg_b.run_dir / "hf-final")
    finally:
        redis_a.stop()
        redis_b.stop()
