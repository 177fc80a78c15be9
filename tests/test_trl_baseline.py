"""benchmarks/trl_grpo.py: TRL's GRPOTrainer set up from an asyncrl config, its run read by smollm2_curve's report."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config

REPO = Path(__file__).resolve().parent.parent


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trl_settings_follow_the_asyncrl_config():
    trl = _bench("trl_grpo")
    cfg = load_config(str(REPO / "configs" / "smollm2_arith.yaml"))
    s = trl.trl_settings(cfg, cuda=True, use_vllm=True)
    assert s["num_generations"] == 8 and s["per_device_train_batch_size"] == 256
    assert s["max_completion_length"] == 32 and s["learning_rate"] == 2e-5 and s["lr_scheduler_type"] == "constant"
    assert (s["epsilon"], s["epsilon_high"], s["beta"]) == (0.2, 0.28, 0.0)
    assert (s["loss_type"], s["scale_rewards"], s["bf16"]) == ("dapo", "group", True)
    assert (s["vllm_mode"], s["vllm_gpu_memory_utilization"], s["vllm_max_model_length"]) == ("colocate", 0.15, 256)
    assert s["model_init_kwargs"] == {"dtype": "float32"}  # fp32 master weights, bf16 autocast
    mb = trl.trl_settings(load_config(None, ["learner.minibatches=2"]), cuda=False, use_vllm=False)
    assert (mb["per_device_train_batch_size"], mb["steps_per_generation"], mb["bf16"]) == (32, 2, False)
    assert "vllm_mode" not in mb
    assert s["gradient_checkpointing"] is False  # as the learner: learner.activation_checkpointing


def test_trl_micro_batches_accumulate_to_the_learners_optimizer_step():
    trl = _bench("trl_grpo")
    cfg = load_config(str(REPO / "configs" / "gsm8k_qwen2.5_coder_0.5b.yaml"))
    s = trl.trl_settings(cfg, cuda=True, use_vllm=True, micro_batch_seqs=16)
    # 256 sequences a step: 16 a forward/backward, 16 accumulated, one generation a step
    assert (s["per_device_train_batch_size"], s["gradient_accumulation_steps"], s["steps_per_generation"]) == (16, 16, 16)
    mb = trl.trl_settings(load_config(None, ["learner.minibatches=2"]), cuda=False, use_vllm=False, micro_batch_seqs=8)
    assert (mb["per_device_train_batch_size"], mb["gradient_accumulation_steps"], mb["steps_per_generation"]) == (8, 4, 8)
    with pytest.raises(SystemExit, match="does not divide"):
        trl.trl_settings(cfg, cuda=True, use_vllm=True, micro_batch_seqs=24)


@pytest.mark.parametrize("override, names", [("algorithm.aggregation=seq_mean_token_sum", "algorithm.aggregation"),
                                             ("algorithm.advantage=rloo", "algorithm.advantage")])
def test_a_setting_trl_has_no_counterpart_for_is_refused(override, names):
    trl = _bench("trl_grpo")
    with pytest.raises(SystemExit, match=names):
        trl.trl_settings(load_config(None, [override]), cuda=False, use_vllm=False)


def test_the_train_dataset_is_named_by_its_rows_without_pickling_its_table(monkeypatch):
    """The dataset TRL trains on gets its fingerprint from the rows' JSON: `datasets`' own fingerprint,
    which dill-pickles the Arrow table and fails on some pyarrow builds, is never computed."""
    import datasets.arrow_dataset

    def unpicklable(_):
        raise TypeError("Can't pickle <class 'MonthDayNano'>")

    monkeypatch.setattr(datasets.arrow_dataset, "generate_fingerprint", unpicklable)
    trl = _bench("trl_grpo")
    rows = [{"prompt": [{"role": "user", "content": f"{i} + 1 ="}], "answer": str(i + 1)} for i in range(5)]
    ds = trl.train_dataset(rows)
    assert ds.to_list() == rows
    assert ds._fingerprint == trl.train_dataset([dict(r) for r in rows])._fingerprint
    assert ds._fingerprint != trl.train_dataset(rows[:4])._fingerprint
    assert trl.train_dataset([{"prompt": "1 + 1 =", "answer": "2"}]).to_list() == [{"prompt": "1 + 1 =", "answer": "2"}]


@pytest.mark.slow
def test_trl_run_trains_evaluates_and_reports_a_curve(tmp_path, tiny_model):
    """Three TRL steps on the tiny model and the copy task, held-out accuracy before the first step and
    every two steps; smollm2_curve.py's report reads the run as it reads an asyncrl run."""
    out = tmp_path / "curve"
    cmd = [sys.executable, str(REPO / "benchmarks" / "trl_grpo.py"), "run", "--skip-convert", "--model", tiny_model,
           "--config", str(REPO / "configs" / "tiny.yaml"), "--vllm", "off", "--budget-s", "240", "--out", str(out),
           "run.max_steps=3", "eval.every=2", "eval.num_prompts=16", "learner.batch_groups=4", "generator.n=4"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = out / "tiny_trl"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert all(b["time"] > a["time"] for a, b in zip(rows, rows[1:], strict=False))
    assert all(row["tokens"] > 0 and 0.0 <= row["reward_mean"] <= 1.0 for row in rows)
    assert any(row["grad_norm"] > 0 for row in rows)  # the policy moved
    assert [e["eval/version"] for e in evals] == [0, 2, 3] and all(e["eval/n"] == 16 for e in evals)
    assert evals[0]["eval/published_at"] < rows[0]["time"] <= evals[1]["eval/published_at"]
    settings = json.loads((run / "launch.json").read_text())["trl_settings"]
    assert (settings["num_generations"], settings["per_device_train_batch_size"]) == (4, 16)
    c = _bench("smollm2_curve").curve(run)
    assert c["mode"] == "trl" and c["steps"] == 3 and c["base_pass@1"] == evals[0]["eval/pass@1"]
    assert [p["version"] for p in c["curve"]] == [0, 2, 3] and c["first_step_s"] > 0
