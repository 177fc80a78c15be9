"""`asyncrl report` on real runs: the tiny model on the copy task and the guessing game played as episodes, every
real component (redis-server, buffer, vLLM CPU generator, FSDP2 learner), then the page made from the
run folder."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import REPO_CONFIGS, load_config
from asyncrl.observe.report import md_text
from asyncrl.tasks.evaluation import load_eval_set
from asyncrl.tasks.rewards import build_reward, is_correct


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run(config, run_dir_parent, *overrides, cwd=None):
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", str(config), f"run.dir={run_dir_parent}", *overrides],
                       capture_output=True, text=True, timeout=900, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _report(run_dir, *argv):
    r = subprocess.run([sys.executable, "-m", "asyncrl", "report", str(run_dir), *argv], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    page, png = map(Path, r.stdout.split())
    assert png.read_bytes()[:4] == b"\x89PNG" and png.parent == page.parent
    return page.read_text()


@pytest.mark.slow
def test_a_run_keeps_its_answers_and_reports_them(tmp_path, tiny_model):
    # The copy task: the warm-started tiny model answers with text (on GSM8K it stops at once).
    _run(REPO_CONFIGS / "tiny.yaml", tmp_path / "runs", "run.max_steps=4", f"model.path={tiny_model}",
         "eval.every=2", "eval.num_prompts=4", "eval.k=2", "eval.show=2")
    run_dir = tmp_path / "runs" / "tiny"
    rounds = _jsonl(run_dir / "eval.jsonl")
    assert [r["eval/version"] for r in rounds] == [0, 2, 4]
    kept = _jsonl(run_dir / "eval_samples.jsonl")
    assert [(r["version"], r["index"]) for r in kept] == [(v, i) for v in (0, 2, 4) for i in (0, 1)]
    held_out = load_eval_set(load_config(run_dir / "config.yaml"))
    reward_fn = build_reward(load_config(run_dir / "config.yaml").reward)
    for row in kept:
        assert (row["prompt_id"], row["prompt"], row["answer"]) == (held_out[row["index"]].prompt_id,
                                                                    held_out[row["index"]].prompt,
                                                                    held_out[row["index"]].answer)
        # The kept text is the text the generator scored: its reward and correctness again.
        assert row["reward"] == pytest.approx(reward_fn(row["completion"], row["answer"]))
        assert row["correct"] == is_correct(reward_fn, row["completion"], row["answer"])
        assert row["step"] >= row["version"] and row["published_at"] <= row["finished_at"]
    assert all(r["completion"].strip() for r in kept) and any(r["reward"] > 0 for r in kept)

    page = _report(run_dir, "--questions", "2")
    assert "# Run tiny" in page
    assert f"| accuracy before training (version 0) | {100 * rounds[0]['eval/pass@1']:.1f}% |" in page
    assert f"| final accuracy | {100 * rounds[-1]['eval/pass@1']:.1f}% (version 4, at " in page
    assert "| steps | 4 (policy version 4) |" in page and "| data.task | copy |" in page
    # Each question: the first round's answer beside the last's, as the learner kept them.
    for i in (0, 1):
        before, after = (next(r for r in kept if r["version"] == v and r["index"] == i) for v in (0, 4))
        assert f"### Question {i + 1} ({md_text(before['prompt_id'])})" in page
        assert f"| {md_text(before['completion'])} | {md_text(after['completion'])} |" in page
        assert f"before (version 0): {'✓ right' if before['correct'] else '✗ wrong'}" in page
    html = _report(run_dir, "--out", str(tmp_path / "page.html"), "--questions", "1")
    assert html.count("<h3>Question") == 1 and "Run tiny" in html


@pytest.mark.slow
def test_an_episode_run_keeps_its_greedy_episodes_turn_by_turn(tmp_path, tiny_model):
    config = Path(__file__).parent.parent / "configs" / "guess_cpu.yaml"
    _run(config, tmp_path, "run.max_steps=2", f"model.path={tiny_model}", "eval.every=2", "eval.num_prompts=2",
         "eval.k=0", "eval.show=2", cwd=tmp_path)
    run_dir = tmp_path / "guess_cpu"
    kept = _jsonl(run_dir / "eval_samples.jsonl")
    assert [(r["version"], r["index"]) for r in kept] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    for row in kept:
        # One `[assistant]` part per assistant turn, the game's replies between them.
        assert row["completion"].startswith("[assistant] ") and row["turns"] >= 1
        assert row["completion"].count("[assistant] ") == row["turns"]
        assert row["completion"].count("[environment] ") in (row["turns"] - 1, row["turns"])
    page = _report(run_dir)
    assert "### Question 2" in page and "\\[assistant\\]" in page
