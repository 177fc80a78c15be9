"""benchmarks/otb_cost.py on a tiny shape: it runs the learner's two no-grad passes and the advantages,
and its results file holds the shape, the step and positive timings."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_otb_cost_writes_its_results(tmp_path):
    out = tmp_path / "otb_cost.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "otb_cost.py"), "--vocab", "256", "--hidden", "32",
         "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64", "--groups", "1", "--n", "2",
         "--comp-len", "4", "24", "--prompt-len", "2", "8", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["shape"]["vocab"] == 256 and result["shape"]["layers"] == 1
    assert result["batch"]["sequences"] == 2 and result["batch"]["completion_tokens"] >= 8
    assert result["max_abs_logp_diff"] < 1e-5  # both passes give the same log-probs
    rows = result["rows"]
    assert set(rows) == {"logprobs_N", "logprobs_sum_pi2_N", "advantage grpo", "advantage optimal_token_baseline"}
    for row in rows.values():
        assert 0 < row["min_s"] <= row["median_s"] and len(row["all_s"]) == 1
    assert rows["logprobs_N"]["ratio_to_plain"] == 1.0
    assert rows["logprobs_sum_pi2_N"]["ratio_to_plain"] > 0
    for name in ("logprobs_N", "logprobs_sum_pi2_N"):
        assert rows[name]["peak_mib"] >= 0 and rows[name]["rss_before_mib"] > 0
    assert "logprobs_sum_pi2_N" in proc.stdout  # the printed table
