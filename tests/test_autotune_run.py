"""`algorithm.max_staleness: auto` inside a real run: the embedded tiny config with every real part
(redis-server, buffer, a vLLM generator on CPU, the torchrun learner), the controller moving the
bound from the learner's own measurements (asyncrl/control.py, learners/autotune.py)."""

import json
import subprocess
import sys

import pytest

LO, HI, STEPS = 0, 2, 24


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _filter_bound(bounds: dict[int, int], step: int) -> int:
    """The learner's staleness filter at `step`: the highest bound in force over the last max + 1
    steps before it (StalenessController.filter_bound); before the first step, the min."""
    return max(bounds.get(j, LO) for j in range(step - 1 - HI, step))


def _events(run_dir) -> list[dict]:
    """Every `staleness_bound` event of the ended run, from the state its run folder saved (the run's
    config names its folder relative to where the run was started: the current directory)."""
    import redis

    from asyncrl.config import load_config
    from asyncrl.observe.ended import open_run
    from asyncrl.protocol.keys import Keys

    cfg = load_config(str(run_dir / "config.yaml"), [])
    with open_run(cfg, cfg.buffer.redis_url) as rr:
        client = redis.Redis.from_url(rr.url, decode_responses=True)
        entries = client.xrange(Keys(cfg.run.name).events)
    return [f for _, f in entries if f.get("kind") == "staleness_bound"]


@pytest.mark.slow
def test_auto_staleness_moves_the_bound_within_its_limits_in_a_real_run(tmp_path, tiny_model, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={STEPS}", f"model.path={tiny_model}",
                        "algorithm.max_staleness=auto", f"algorithm.autotune.min={LO}", f"algorithm.autotune.max={HI}"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny"
    rows = _metrics(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    print("staleness_bound per step:", [int(row["staleness_bound"]) for row in rows])
    # Every row carries the bound in force, within the limits.
    assert all(LO <= row["staleness_bound"] <= HI and row["staleness_bound"] == int(row["staleness_bound"])
               for row in rows), [row.get("staleness_bound") for row in rows]
    bounds = {row["step"]: int(row["staleness_bound"]) for row in rows}
    # No trained group lagged more than the filter let through at its step.
    over = [(row["step"], row["lag_max"], _filter_bound(bounds, row["step"])) for row in rows
            if row["lag_max"] > _filter_bound(bounds, row["step"])]
    assert not over, over
    # The run learned as the default run does.
    first = sum(row["reward_mean"] for row in rows[:4]) / 4
    last = sum(row["reward_mean"] for row in rows[-6:]) / 6
    assert last > first + 0.08, f"reward did not rise: first={first:.3f} last={last:.3f}"
    # The buffer's admission follows the bound in force: hardly any generation is dropped as stale.
    assert rows[-1]["dropped_frac"] < 0.02, [(row["staleness_bound"], row["dropped_stale"]) for row in rows]
    # Every move: a row with its reason, an event, a log line; none without a move.
    before = [LO] + [bounds[s] for s in range(1, STEPS)]
    moved = [row for row, old in zip(rows, before, strict=True) if int(row["staleness_bound"]) != old]
    assert moved, f"the bound never left {LO} in {STEPS} steps: {[row.get('data_wait_s') for row in rows]}"
    assert [row["step"] for row in rows if "staleness_change" in row] == [row["step"] for row in moved]
    for row, old in zip(rows, before, strict=True):
        if "staleness_change" in row:
            old_new, reason = row["staleness_change"].split(": ", 1)
            assert old_new == f"{old} -> {int(row['staleness_bound'])}" and reason.strip(), row["staleness_change"]
    events = _events(run_dir)
    assert [(int(e["old"]), int(e["new"])) for e in events] == \
        [(old, int(row["staleness_bound"])) for row, old in zip(rows, before, strict=True) if row in moved], events
    assert all(e["reason"] for e in events)
    for row in moved:
        assert f"staleness bound {row['staleness_change']}" in r.stdout + r.stderr, row["staleness_change"]
    # `asyncrl status` of the ended run shows the bound in force at the end.
    st = subprocess.run([sys.executable, "-m", "asyncrl", "status", "runs/tiny/config.yaml", "--once", "--json"],
                        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert st.returncode == 0, st.stderr
    snap = json.loads(st.stdout)
    assert snap["ended"] and snap["learner"]["staleness_bound"] == rows[-1]["staleness_bound"], snap["learner"]
