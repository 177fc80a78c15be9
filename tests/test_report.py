"""`asyncrl report`: the held-out answers the learner keeps (eval.show), and the page built from a run
folder: its numbers, its escaping, and a one-line error for each folder it cannot report on."""

import html
import json
import re
import subprocess
import sys
import time
from html.parser import HTMLParser

import msgspec
import pytest
import redis

from asyncrl.config import load_config
from asyncrl.observe.report import ReportError, load_run, md_text, pair_answers, training_table, write_report
from asyncrl.protocol import schema
from asyncrl.tasks.evaluation import eval_results_key, load_eval_set, make_tasks
from learners.evaluation import Evaluator

T0 = 1_700_000_000.0  # the learner's start in the hand-written runs


def _write(path, rows, partial: str = ""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + partial)


def _hand_run(run_dir, passes=(0.20, 0.20, 0.30, 0.45, 0.40), show=3, steps=20):
    """A run folder as the learner writes it: a step every 2 s from 10 s after the start, a round every
    5 steps (version = step) published 2 s after its step's row, the first `show` answers of each."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text("run:\n  name: handmade\n  mode: async\nmodel:\n  path: Org/Model-0.5B\n"
                                         "data:\n  task: gsm8k\neval:\n  every: 5\n  num_prompts: 20\n  k: 2\n")
    _write(run_dir / "metrics.jsonl",
           [{"step": s, "version": s, "time": T0 + 10 + 2 * s, "elapsed_s": 10.0 + 2 * s, "reward_mean": s / 100,
             "compute_s": 1.5, "idle_ratio": 0.5 if s <= 2 else (0.5 * 14 + 0.0 * (2 * s - 4)) / (10 + 2 * s),
             "gen_tokens_per_s": 100.0 * s} for s in range(1, steps + 1)])
    versions = [5 * i for i in range(len(passes))]
    _write(run_dir / "eval.jsonl", [{"step": v, "eval/version": v, "eval/pass@1": p, "eval/mean@k": p / 2, "eval/k": 2,
                                     "eval/num_prompts": 20, "eval/published_at": T0 + 12 + 2 * v, "eval/seconds": 3.0}
                                    for v, p in zip(versions, passes, strict=True)])
    _write(run_dir / "eval_samples.jsonl",
           [{"step": v, "version": v, "published_at": T0 + 12 + 2 * v, "finished_at": T0 + 13 + 2 * v, "index": i,
             "prompt_id": f"q{i}", "prompt": f"question {i}", "answer": str(i), "completion": f"v{v} says {i + v % 2}",
             "reward": float((i + v % 2) == i), "correct": (i + v % 2) == i, "turns": 0, "tool_calls": 0}
            for v in versions for i in range(show)])
    return run_dir


# ---- the numbers on the page ---------------------------------------------------------------------


def test_page_numbers_from_hand_written_rows(tmp_path):
    run_dir = _hand_run(tmp_path / "handmade")
    page, png = write_report(run_dir)
    assert page == run_dir / "report.md" and png == run_dir / "report_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](report_accuracy.png)" in page.read_text()
    text = page.read_text()
    assert "# Run handmade" in text
    # Wall time: the start to the last round's end (version 20: published at 52 s, 3 s long) = 55 s.
    assert "| wall time | 0.9 min since the learner's start |" in text
    assert "| accuracy before training (version 0) | 20.0% |" in text
    assert "| best accuracy | 45.0% (version 15, at 0.7 min) |" in text  # published at 12 + 30 = 42 s
    assert "| final accuracy | 40.0% (version 20, at 0.9 min; +20.0 points) |" in text
    # +5 points: 30% at version 10 (31 s); +10 points (30.0%), at 32 s, too: 0.30 >= 0.20 + 0.10 despite float rounding.
    assert "| time to base + 5 points (25.0%) | 0.5 min (version 10, step 10: 30.0%) |" in text
    assert "| time to base + 10 points (30.0%) | 0.5 min (version 10, step 10: 30.0%) |" in text
    assert "| model.path | Org/Model\\-0.5B |" not in text and "| model.path | Org/Model-0.5B |" in text
    assert "| eval.every | 5 |" in text


def test_an_accuracy_gain_not_reached_says_so(tmp_path):
    run_dir = _hand_run(tmp_path / "flat", passes=(0.5, 0.52, 0.49))
    text = write_report(run_dir)[0].read_text()
    assert "| time to base + 5 points (55.0%) | not reached |" in text
    assert "| time to base + 10 points (60.0%) | not reached |" in text


def test_training_table_compares_the_first_and_last_tenth(tmp_path):
    run = load_run(_hand_run(tmp_path / "handmade"))
    table = {row[0]: row[1:] for row in training_table(run.metrics)}
    assert table[""] == ("steps 1-2", "steps 19-20", "whole run")
    assert table["reward mean"] == ("0.015", "0.195", "0.105")
    assert table["wall seconds per step"] == ("2.00", "2.00", "2.00")  # the first row has no row before it
    # idle_ratio counts from the learner's start: 50% over the first 14 s, none after; the last tenth's
    # share is the difference of the cumulative idle seconds.
    assert table["learner idle"] == ("50%", "0%", "14%")
    assert table["generated tokens/s"] == ("150", "1,950", "1,050")


def test_answers_pair_the_first_and_last_round_and_count_flips(tmp_path):
    run = load_run(_hand_run(tmp_path / "handmade", show=4))
    answers = pair_answers(run.samples, 2)
    assert (answers.before_version, answers.after_version) == (0, 20)
    assert [q.prompt_id for q in answers.questions] == ["q0", "q1"]
    q = answers.questions[1]
    assert (q.before.text, q.before.correct, q.after.text, q.after.correct) == ("v0 says 1", True, "v20 says 1", True)
    assert answers.flips == (0, 0)
    samples = [dict(r, correct=r["version"] == 20) for r in run.samples]
    assert pair_answers(samples, 2).flips == (4, 0)  # counted over all four kept, not the two shown
    assert pair_answers(samples, 0).questions == []
    one_round = [r for r in run.samples if r["version"] == 0]
    only = pair_answers(one_round, 3)
    assert only.after_version is None and len(only.questions) == 3 and only.questions[0].after is None


def test_a_live_run_reads_complete_rows_only(tmp_path):
    run_dir = _hand_run(tmp_path / "live")
    with open(run_dir / "eval.jsonl", "a") as f:
        f.write('{"step": 25, "eval/version": 25, "eval/pass@1": 0.9')  # a row being written
    with open(run_dir / "eval_samples.jsonl", "a") as f:
        f.write('{"step": 25, "version": 25, "prompt_id": "q0", "comp')
    run = load_run(run_dir)
    assert [r["eval/version"] for r in run.rounds] == [0, 5, 10, 15, 20]
    assert pair_answers(run.samples, 5).after_version == 20
    assert "| final accuracy | 40.0% (version 20" in write_report(run_dir)[0].read_text()


def test_times_count_from_the_launch_where_the_folder_records_it(tmp_path):
    run_dir = _hand_run(tmp_path / "launched")
    (run_dir / "launch.json").write_text(json.dumps({"t_launch": T0 - 30, "mode": "async"}))
    text = write_report(run_dir)[0].read_text()
    assert "| wall time | 1.4 min since the launch |" in text  # 30 s before the learner's start, 55 s after
    assert "| time to base + 5 points (25.0%) | 1.0 min (version 10" in text  # 30 + 32 s


# ---- escaping ------------------------------------------------------------------------------------

NASTY = ["What is 2 | 3 * $4_x <b>bold</b>? [link](http://x) `code` ~~gone~~ &amp; \\ end",
         "# not a heading\n- not a list\n1. not a list\n> not a quote\n    not code\n===",
         "<script>alert(1)</script>", "$5 + $6 = $11", "  ", "Tom's \"quote\" & 5 < 6 > 4"]


class _Text(HTMLParser):
    """The text a browser shows (<br> as a newline) and the tags it would build."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.tags = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "br":
            self.parts.append("\n")

    def handle_data(self, data):
        self.parts.append(data)


def _shown(rendered: str) -> tuple[str, list[str]]:
    p = _Text()
    p.feed(rendered)
    return "".join(p.parts), p.tags


def _words(text: str) -> str:
    return " ".join(text.split())  # what a browser shows outside <pre>: runs of white space as one


@pytest.mark.parametrize("text", NASTY)
def test_markdown_escaping_shows_the_text_as_it_is(text):
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable("table").enable("strikethrough")
    expected = _words(text) or "(empty)"
    cell = md.render(f"| a | b |\n|---|---|\n| {md_text(text)} | x |\n")
    shown, tags = _shown(cell[cell.index("<td>"):cell.index("</td>") + 5])
    assert _words(shown) == expected and set(tags) <= {"td", "br", "em"}, (cell, tags)
    quote = md.render(f"> {md_text(text, block=True)}\n")
    shown, tags = _shown(quote)
    assert _words(shown) == expected and set(tags) <= {"blockquote", "p", "br", "em"}, (quote, tags)
    assert re.search(r"(?<!\\)\$", md_text(text)) is None  # GitHub reads $...$ as math


def test_html_page_escapes_questions_and_answers(tmp_path):
    run_dir = _hand_run(tmp_path / "escaped", show=1)
    rows = [json.loads(line) for line in (run_dir / "eval_samples.jsonl").read_text().splitlines()]
    _write(run_dir / "eval_samples.jsonl", [dict(r, prompt=NASTY[0], completion=NASTY[2], answer="<i>7</i>")
                                            for r in rows])
    page = write_report(run_dir, tmp_path / "out" / "page.html")[0]
    assert (tmp_path / "out" / "page_accuracy.png").exists()
    shown, tags = _shown(page.read_text())
    assert "script" not in tags and "i" not in tags and "<script>alert(1)</script>" in shown
    assert NASTY[0] in shown and "<i>7</i>" in shown and html.escape(NASTY[2]) in page.read_text()


# ---- bad input: one line, exit 2 ---------------------------------------------------------------------


def _report(*argv, cwd=None):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "asyncrl", "report", *map(str, argv)], capture_output=True, text=True,
                       timeout=60, cwd=cwd)
    return r, time.perf_counter() - t0


def test_errors_are_one_line_each(tmp_path):
    (tmp_path / "empty").mkdir()
    no_eval = tmp_path / "no_eval"
    no_eval.mkdir()
    (no_eval / "config.yaml").write_text("run:\n  name: no_eval\neval:\n  every: 0\n")
    _write(no_eval / "metrics.jsonl", [{"step": 1, "time": T0, "elapsed_s": 1.0}])
    waiting = _hand_run(tmp_path / "waiting")
    (waiting / "eval.jsonl").write_text("")
    timed_out = _hand_run(tmp_path / "timed_out")
    _write(timed_out / "eval.jsonl", [{"step": 5, "eval/version": 5, "eval/incomplete": True}])
    good = _hand_run(tmp_path / "good")
    cases = [((tmp_path / "missing",), "is not a folder"),
             ((tmp_path / "empty",), "is not a run folder (no metrics.jsonl, eval.jsonl or config.yaml)"),
             ((no_eval,), "the run does not evaluate: set eval.every"),
             ((waiting,), "none has finished yet"),
             ((timed_out,), "1 round(s) timed out unfinished (eval.timeout_s)"),
             ((good, "--out", tmp_path / "page.pdf"), "ends in .md or .html"),
             ((good, "--questions", "-1"), "--questions must be 0 or more")]
    for argv, message in cases:
        r, seconds = _report(*argv)
        assert r.returncode == 2 and message in r.stderr, (argv, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("asyncrl report: "), r.stderr
        assert seconds < 20
    assert not (good / "report.md").exists() and not (tmp_path / "page.pdf").exists()
    r, _ = _report(good, "--questions", "2")
    assert r.returncode == 0 and r.stdout.split() == [str(good / "report.md"), str(good / "report_accuracy.png")]
    assert (good / "report.md").read_text().count("### Question") == 2


def test_load_run_refuses_a_file_that_is_not_json_lines(tmp_path):
    run_dir = _hand_run(tmp_path / "garbled")
    (run_dir / "eval.jsonl").write_text("not json\n")
    with pytest.raises(ReportError, match="is not JSON"):
        load_run(run_dir)


# ---- what the learner keeps: eval.show on the eval wire --------------------------------------------


def test_eval_tasks_ask_for_the_first_show_answers_and_old_frames_decode():
    cfg = load_config(None, ["eval.every=1", "eval.num_prompts=5", "eval.show=2"])
    tasks = make_tasks(load_eval_set(cfg), 3, 2, 1.0, show=cfg.eval.show)
    assert [t.show for t in tasks] == [True, True, False, False, False]
    assert schema.decode(schema.encode(tasks[0]), schema.EvalTask) == tasks[0]
    assert load_config(None, []).eval.show == 8
    result = schema.EvalResult(schema_version=schema.SCHEMA_VERSION, round_id="v3", version=3, prompt_id="p",
                               generator_id="g", greedy_correct=True, greedy_reward=1.0, sample_correct=b"",
                               sample_rewards=b"", min_version=3, num_tokens=4, finished_at=1.0, greedy_text="42 <b>")
    assert schema.decode(schema.encode(result), schema.EvalResult).greedy_text == "42 <b>"
    # A result of code before the field (its frame has no greedy_text): decoded as "not kept", not "".
    old = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(result).items() if k != "greedy_text"} |
                                 {"type": "eval_result"})
    assert schema.decode(old, schema.EvalResult).greedy_text is None


def _answer_round(client, cfg, tasks, text_of):
    for t in tasks:
        result = schema.EvalResult(
            schema_version=schema.SCHEMA_VERSION, round_id=t.round_id, version=t.version, prompt_id=t.prompt_id,
            generator_id="g0", greedy_correct=t.prompt_id.endswith("0"), greedy_reward=0.5, sample_correct=b"",
            sample_rewards=b"", min_version=t.version, num_tokens=3, finished_at=time.time(),
            greedy_text=text_of(t) if t.show else None)
        client.xadd(eval_results_key(cfg.run.name), {"data": schema.encode(result)})


def test_learner_keeps_the_shown_answers_of_each_round(tmp_path, redis_server):
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=kept", "eval.every=2", "eval.num_prompts=4", "eval.k=0",
                             "eval.show=3", "run.max_steps=10"])
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "eval.jsonl").write_text('{"eval/version": 0, "eval/pass@1": 1.0}\n')  # an earlier run's
    client = redis.Redis.from_url(redis_server.url)
    ev = Evaluator(cfg, client)  # a fresh learner: publishes version 0
    aside = sorted(p.name for p in cfg.run_dir.glob("eval.*.jsonl"))
    assert len(aside) == 1 and not (cfg.run_dir / "eval.jsonl").exists()
    rows = load_eval_set(cfg)
    for version, step in ((0, 1), (2, 2)):
        if version:
            ev.publish(version)
        tasks = make_tasks(rows, version, 0, 0.0, show=3)
        _answer_round(client, cfg, tasks, lambda t, v=version: f"answer {t.prompt_id} at {v}" if t.prompt_id
                      != rows[2].prompt_id else "")
        ev.collect()
        assert ev.finish(step)
    kept = [json.loads(line) for line in (cfg.run_dir / "eval_samples.jsonl").read_text().splitlines()]
    assert [(r["version"], r["index"]) for r in kept] == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    first = kept[0]
    assert first["prompt"] == rows[0].prompt and first["answer"] == rows[0].answer and first["step"] == 1
    assert first["completion"] == f"answer {rows[0].prompt_id} at 0" and first["reward"] == 0.5
    assert first["correct"] == rows[0].prompt_id.endswith("0") and first["published_at"] > 0
    assert kept[2]["completion"] == ""  # an empty answer is kept as one
    # A resumed learner (version > 0) appends to the run's rounds.
    Evaluator(cfg, client, start_version=2)
    assert (cfg.run_dir / "eval_samples.jsonl").exists() and (cfg.run_dir / "eval.jsonl").exists()
