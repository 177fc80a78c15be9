"""Accuracy curves: `asyncrl plot` with evaluation rounds and `--x time`, the SmolLM2 curve report's
time to each accuracy, and the one-host weight backend the launcher picks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.launch.launcher import local_weights_backend

REPO = Path(__file__).resolve().parents[1]


def _write_run(run_dir: Path, t_launch: float, accuracies: list[float], mode: str = "async") -> None:
    """A run as `benchmarks/smollm2_curve.py run` leaves it: metrics rows every 2 s from t_launch + 30 s,
    an evaluation round every 5 steps whose weights were current 1 s before its step row."""
    run_dir.mkdir(parents=True)
    rows, evals = [], []
    for step in range(1, 5 * (len(accuracies) - 1) + 1):
        t = t_launch + 30 + 2 * step
        rows.append({"step": step, "version": step, "time": t, "elapsed_s": 2 * step, "reward_mean": 0.1 * step,
                     "sync_s": 0.5, "step_s": 0.2, "lag_hist": {"1": 3}, "lag_mean": 1.0, "lag_max": 1})
    for i, acc in enumerate(accuracies):
        version = 5 * i
        published = t_launch + 30 + 2 * version - 1
        ev = {"step": max(version, 1), "eval/version": version, "eval/pass@1": acc, "eval/pass@k": acc,
              "eval/mean@k": acc, "eval/published_at": published}
        evals.append(ev)
        rows[max(version, 1) - 1].update({k: v for k, v in ev.items() if k != "step"})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    (run_dir / "launch.json").write_text(json.dumps({"mode": mode, "config": "c.yaml", "overrides": [],
                                                     "budget_s": 100, "t_launch": t_launch, "wall_s": 99.0,
                                                     "rc": 130}))


def test_plot_draws_held_out_accuracy_against_steps_and_wall_time(tmp_path):
    import matplotlib.image

    run = tmp_path / "run"
    _write_run(run, 1000.0, [0.1, 0.3, 0.6])
    for x in ("step", "time"):
        out = tmp_path / f"plots-{x}"
        r = subprocess.run([sys.executable, "-m", "asyncrl", "plot", str(run), "--out", str(out), "--x", x],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert matplotlib.image.imread(out / "eval.png").std() > 0.01, "eval.png is blank"


def test_plot_without_evaluation_rounds_draws_no_accuracy(tmp_path):
    from asyncrl.observe.plot import plot_run

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "time": 5.0, "reward_mean": 0.5}) + "\n")
    names = {p.name for p in plot_run(run, x="time")}
    assert "reward.png" in names and "eval.png" not in names


def test_curve_report_times_each_accuracy_from_the_launch(tmp_path):
    spec = importlib.util.spec_from_file_location("smollm2_curve", REPO / "benchmarks" / "smollm2_curve.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    _write_run(tmp_path / "a", 1000.0, [0.05, 0.35, 0.45, 0.72, 0.5])
    c = bench.curve(tmp_path / "a")
    # Round i's weights were current at 30 + 10 i - 1 s after the launch.
    assert c["base_pass@1"] == 0.05 and c["best_pass@1"] == 0.72 and c["final_pass@1"] == 0.5
    assert c["time_to_pass@1_s"] == {"0.3": 39.0, "0.4": 49.0, "0.5": 59.0, "0.6": 59.0, "0.7": 59.0}
    assert c["first_step_s"] == 32.0 and c["steps"] == 20 and c["median_step_s"] == 2.0
    # +5/+10/+15 points over version 0's 0.05: 0.35 (round 1) reaches all three.
    assert c["time_to_base_plus_points_s"] == {"+5": 39.0, "+10": 39.0, "+15": 39.0}
    _write_run(tmp_path / "b", 2000.0, [0.05, 0.2], mode="sync")
    assert bench.curve(tmp_path / "b")["time_to_base_plus_points_s"] == {"+5": 39.0, "+10": 39.0, "+15": 39.0}
    _write_run(tmp_path / "c", 3000.0, [0.30, 0.36, 0.41, 0.44])
    assert bench.curve(tmp_path / "c")["time_to_base_plus_points_s"] == {"+5": 39.0, "+10": 49.0, "+15": None}
    assert bench.curve(tmp_path / "b")["time_to_pass@1_s"]["0.3"] is None  # never reached: no time


@pytest.mark.parametrize("setting", ["auto", "nccl", "gloo", "ipc"])
def test_one_host_run_keeps_the_weights_backend(setting):
    # auto stays auto: the learner picks gloo on CPU and ipc on CUDA for members on its node.
    assert local_weights_backend(load_config(None, [f"weights.backend={setting}"])) == setting


@pytest.mark.parametrize("start_version, rounds", [(0, [0]), (7, [])])
def test_the_starting_weights_are_evaluated_only_when_training_starts_from_them(redis_server, start_version,
                                                                               rounds):
    import redis as redis_py

    from learners.evaluation import Evaluator

    cfg = load_config(None, [f"run.name=ev{start_version}", "eval.every=5", "eval.num_prompts=3"])
    client = redis_py.Redis.from_url(redis_server.url)
    ev = Evaluator(cfg, client, start_version=start_version)  # a resumed learner starts at its checkpoint's
    assert sorted(r.version for r in ev.rounds.values()) == rounds


def test_a_node_name_that_resolves_to_loopback_is_refused_for_a_multi_node_listener(monkeypatch):
    import socket

    from asyncrl.protocol import tcpstore

    def resolve(host, port, type=0):  # Debian's /etc/hosts: 127.0.1.1 <hostname>
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", port))]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with pytest.raises(ValueError, match="resolves to the loopback address 127.0.1.1"):
        tcpstore.listening_socket("node-a", 0)
    tcpstore.listening_socket("127.0.0.1", 0).close()  # loopback asked for: bound
