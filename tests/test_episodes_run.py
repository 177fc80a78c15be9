"""Multi-turn episodes through the whole pipeline: redis-server, buffer, the vLLM CPU generator playing
the guessing game, the FSDP2 learner training on the policy's tokens."""

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_guessing_game_runs_multi_turn_episodes_end_to_end(tmp_path):
    steps = 3
    config = (Path(__file__).parent.parent / "configs" / "guess_cpu.yaml")
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", str(config), f"run.max_steps={steps}",
                        f"run.dir={tmp_path}", f"eval.every={steps}", "eval.num_prompts=4", "eval.k=2"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # The run says what it shows, at its start and at its end: a path check, not learning.
    purpose = [line for line in r.stdout.splitlines() if line.startswith("purpose: a path check, not learning")]
    assert len(purpose) == 2 and r.stdout.rstrip().endswith(purpose[1]), r.stdout[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "guess_cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    print("tool errors an episode:", [row["episode/tool_errors_mean"] for row in rows])
    for row in rows:
        # Episodes of several turns, each turn answered by the game; observations are not the policy's.
        assert 1 < row["episode/turns_mean"] <= 4 and row["episode/turns_max"] <= 4
        assert 0 < row["episode/policy_token_frac"] < 1
        assert row["episode/tool_calls_mean"] + row["episode/tool_errors_mean"] > 0
        assert row["episode/env_s_mean"] >= 0
        ends = sum(v for k, v in row.items() if k.startswith("episode/end_"))
        assert ends == pytest.approx(1.0)
        # The learner's token count is the policy's tokens only: at most max_tokens (4) per turn.
        assert 0 < row["tokens"] <= 2 * 4 * row["episode/turns_mean"] * 4 * 4
        assert row["loss"] == row["loss"] and row["grad_norm"] == row["grad_norm"]  # finite, trained
    # The held-out round is played as episodes too: a greedy one and eval.k sampled ones per prompt.
    rounds = [json.loads(line) for line in (tmp_path / "guess_cpu" / "eval.jsonl").read_text().splitlines()]
    assert [r["eval/version"] for r in rounds] == [0, steps]  # before training (eval.before_train) and at the end
    for round_ in rounds:
        assert round_["eval/num_prompts"] == 4 and round_["eval/k"] == 2 and round_["eval/tokens"] > 0
        assert 0 <= round_["eval/pass@1"] <= 1 and 0 <= round_["eval/mean@k"] <= round_["eval/pass@k"] <= 1
        # The greedy episodes' turns and tool calls, as the generator's evaluation reports them (each
        # readable guess is a call of the game's one action).
        assert 1 <= round_["eval/turns_mean"] <= 4
        assert 0 <= round_["eval/tool_calls_mean"] <= round_["eval/turns_mean"]
        assert 0 <= round_["eval/tool_call_frac"] <= 1
    # `asyncrl inspect` shows an episode turn by turn: the assistant's turns and the game's replies.
    r = subprocess.run([sys.executable, "-m", "asyncrl", "inspect", str(tmp_path / "guess_cpu" / "config.yaml"),
                        "-n", "1", "--samples", "2", "--json", "--no-current"], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (group,) = json.loads(r.stdout)["groups"]
    for sample in group["samples"]:
        turns, episode = sample["turns"], sample["episode"]
        assert [t["role"] for t in turns][::2] == ["assistant"] * len(turns[::2])
        assert sum(t["role"] == "assistant" for t in turns) == episode["turns"]
        assert {t["policy"] for t in sample["tokens"]} == ({True, False} if episode["turns"] > 1 else {True})
