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
