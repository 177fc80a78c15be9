"""The Slurm and Ray learners start torchrun so that its c10d rendezvous store listens on the endpoint's
address only: the rendered commands, and the listening sockets of a live torchrun started that way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from asyncrl.config import load_config
from asyncrl.launch.deploy_ray import learner_argv
from asyncrl.launch.deploy_slurm import SlurmPlan, render
from asyncrl.launch.redis_server import free_port

REPO = Path(__file__).resolve().parent.parent


def _slurm_torchrun_module(tmp_path, nodes: int) -> str:
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"])
    text = render("learner", cfg, SlurmPlan(num_generators=1, learner_nodes=nodes), tmp_path / "c.yaml")
    modules = re.findall(r"-m (\S+) --nnodes", text)
    assert len(modules) == 1, text
    return modules[0]


def test_slurm_and_ray_learners_start_torchrun_through_the_bound_store():
    cfg = load_config("configs/tiny.yaml", [])
    argv = learner_argv(cfg, 2, "10.0.0.5", 29400, "c.yaml", "redis://10.0.0.1:6379/0")
    assert argv[1:3] == ["-m", "asyncrl.launch.listen"] and "--rdzv-endpoint" in argv
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.0.0.5:29400"


def _listeners(root: psutil.Process) -> list[tuple[str, int]]:
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            out += [(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def test_a_live_c10d_rendezvous_started_as_the_deploy_paths_do_listens_on_its_endpoint_only(tmp_path):
    module = _slurm_torchrun_module(tmp_path, nodes=1)
    cfg = load_config("configs/tiny.yaml", [])
    port = free_port()
    ray_argv = learner_argv(cfg, 1, "127.0.0.1", port, "c.yaml", "redis://127.0.0.1:1/0")
    assert ray_argv[1:3] == ["-m", module], "the Slurm and Ray learners start torchrun the same way"
    script = tmp_path / "rank.py"
    script.write_text("import time\ntime.sleep(60)\n")
    # The deploy paths' command with the rank replaced by a script that only waits.
    argv = ray_argv[: ray_argv.index("-m", 3)] + [str(script)]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        root = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        listening = []
        while time.monotonic() < deadline and not any(p == port for _, p in listening):
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.3)
            listening = _listeners(root)
        assert any(p == port for _, p in listening), listening
        assert all(ip == "127.0.0.1" for ip, _ in listening), listening
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
