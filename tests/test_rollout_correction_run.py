"""The asynchronous corrections in a real run: the embedded default demo (`asyncrl run`, tiny model,
CPU) for a few steps with token- and sequence-level rejection sampling and IS normalisation under
decoupled PPO finishes and logs its rejection / normalisation statistics in every step's metrics
row. TIS and MIS with IS normalisation and sequence rejection: the learner on fixed groups,
tests/test_learner_variants.py."""

import json
import subprocess
import sys

import pytest

CORRECTIONS = ["algorithm.loss=decoupled_ppo", "algorithm.rollout_rs=[token_k1,seq_mean_k3]",
               "algorithm.rollout_rs_threshold=[1.5,0.01]", "algorithm.is_normalize=true"]


@pytest.mark.slow
def test_demo_run_logs_correction_statistics(tmp_path):
    steps = 3
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={steps}", *CORRECTIONS],
                       capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        # The off-policy diagnostics of every step, whatever the correction.
        assert row["ess"] > 0 and row["is_weight_mean"] > 0 and row["entropy"] > 0
        assert row["is_norm_factor"] > 0
        assert 0 <= row["rs_token_reject_frac"] <= 1 and 0 <= row["rs_seq_reject_frac"] <= 1
    assert {"rs_token_k1_frac", "rs_seq_mean_k3_frac"} <= set(rows[-1])
    # The normaliser is the batch mean of the loss's IS weight: it moves with the data, it is not a constant.
    assert len({round(row["is_norm_factor"], 9) for row in rows}) > 1
