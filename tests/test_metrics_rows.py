"""metrics.jsonl holds each step once: a resumed learner's first row supersedes the rows of that step
and later (moved aside, not lost), and a row cut short by a killed writer does not merge into the next."""

import json

from asyncrl.observe.metrics import JsonlBackend, complete_rows


def test_a_resumed_writer_supersedes_the_steps_it_trains_again(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlBackend(path)
    for step in range(1, 11):
        first.log(step, {"step": step, "loss": 1.0})
    resumed = JsonlBackend(path)  # resumed from the checkpoint of step 8
    for step in range(9, 13):
        resumed.log(step, {"step": step, "loss": 2.0})
    rows = complete_rows(path)
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert [r["loss"] for r in rows] == [1.0] * 8 + [2.0] * 4
    aside = complete_rows(tmp_path / "metrics.rolled_back.jsonl")
    assert [(r["step"], r["loss"]) for r in aside] == [(9, 1.0), (10, 1.0)]


def test_a_row_cut_short_is_dropped_before_the_next_is_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"step": 2, "lo')
    JsonlBackend(path).log(2, {"step": 2})
    assert [r["step"] for r in complete_rows(path)] == [1, 2]
    assert not (tmp_path / "metrics.rolled_back.jsonl").exists()


def test_a_fresh_writer_leaves_earlier_steps_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    JsonlBackend(path).log(1, {"step": 1})
    JsonlBackend(path).log(2, {"step": 2})
    assert [r["step"] for r in complete_rows(path)] == [1, 2]


def test_a_fresh_run_sets_the_earlier_runs_rows_evaluations_and_plots_aside(tmp_path, redis_server):
    import redis as redis_py

    from asyncrl.config import load_config
    from asyncrl.launch.launcher import Launcher

    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=again"])
    run_dir = cfg.run_dir
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "plots" / "reward.png").write_bytes(b"png")
    for name in ("metrics", "eval", "eval_samples"):
        (run_dir / f"{name}.jsonl").write_text('{"step": 1}\n')
    client = redis_py.Redis.from_url(redis_server.url)
    client.set("asyncrl:again:version", 7)
    Launcher(cfg)._set_aside_earlier_run(client)
    assert not client.exists("asyncrl:again:version")
    assert not (run_dir / "plots").exists()
    assert not any((run_dir / f"{name}.jsonl").exists() for name in ("metrics", "eval", "eval_samples"))
    kept = sorted(p.name.split(".")[0] for p in run_dir.iterdir())
    assert kept == ["eval", "eval_samples", "metrics", "plots"]  # each under its name and a time stamp
