"""Per-role CPU affinity (`generator.cpus`, `learner.cpus`, `buffer.cpus`): the processes the launcher
starts, what they start in turn, the local redis-server and a role started on its own really run on
the CPUs asked for, read back from /proc of the live processes."""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.affinity import (
    auto_assignment,
    auto_split,
    check_available,
    format_cpus,
    parse_cpus,
    role_env,
)
from asyncrl.launch.launcher import Launcher
from asyncrl.launch.redis_server import LocalRedis

ALLOWED = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs to pin roles apart")


def cpus_allowed(pid: int) -> set[int]:
    """The affinity of a live process as the kernel reports it (/proc/PID/status Cpus_allowed_list)."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("Cpus_allowed_list:"))
    return set(parse_cpus(line.split(":", 1)[1].strip()))


def thread_cpus(pid: int) -> list[set[int]]:
    """The affinity of each of a process's threads that is still alive once its turn comes (a
    short-lived thread may end between the listing and the read)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.append(cpus_allowed(int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [i.decode() for i in f.read().split(b"\0") if i]
    return dict(i.split("=", 1) for i in items if "=" in i)


def test_cpu_lists_parse_format_and_errors_name_the_key():
    assert parse_cpus("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpus(" 2,0,1 ") == (0, 1, 2) and parse_cpus("") == ()
    assert format_cpus((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"
    for bad in ("x", "3-1", "1-", "-1", ","):
        with pytest.raises(ConfigError, match=r"generator\.cpus"):
            load_config(None, [f"generator.cpus={bad}"])
    with pytest.raises(ConfigError, match=r"learner\.cpus='0' has 1 CPUs for learner\.nproc=2"):
        load_config(None, ["learner.cpus=0", "learner.nproc=2"])
    with pytest.raises(ConfigError, match=r"generator\.cpus='0-2'.*tensor_parallel_size=2"):
        load_config(None, ["generator.cpus=0-2", "generator.tensor_parallel_size=2"])
    missing = max(ALLOWED) + 1
    cfg = load_config(None, [f"buffer.cpus={ALLOWED[0]},{missing}"])  # valid syntax, absent CPU
    with pytest.raises(ConfigError, match=rf"buffer\.cpus=.*CPU {missing} is not available.*allowed: "):
        check_available(cfg)


def test_an_absent_cpu_stops_a_role_at_start_with_the_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "asyncrl", "buffer", f"run.dir={tmp_path}",
                        f"buffer.cpus={max(ALLOWED) + 1}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "config error: buffer.cpus=" in r.stderr and "is not available" in r.stderr


def test_thread_environment_follows_the_cpus():
    cfg = load_config(None, ["generator.cpus=0-3", "generator.tensor_parallel_size=2", "learner.cpus=4-7",
                             "learner.nproc=2"])
    # vLLM's CPU build binds one OpenMP thread per listed CPU, one "|" part per worker.
    assert role_env(cfg, "generator") == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "OMP_NUM_THREADS": "2"}
    assert role_env(cfg, "learner") == {"OMP_NUM_THREADS": "2"}
    assert role_env(cfg, "buffer") == {} and role_env(load_config(None, []), "generator") == {}


def test_auto_affinity_splits_small_machines_and_leaves_the_rest():
    """run.affinity=auto: the learner and vLLM each get their own CPU on 2-4 CPUs; 1 CPU or more than 4: nothing."""
    assert auto_split([0]) is None and auto_split(range(8)) is None and auto_split([]) is None
    assert auto_split([0, 1]) == {"generator": (0,), "learner": (1,), "buffer": (0,)}
    assert auto_split([0, 1, 2]) == {"generator": (0,), "learner": (1,), "buffer": (2,)}
    assert auto_split([0, 1, 2, 3]) == {"generator": (0, 1), "learner": (2,), "buffer": (3,)}
    assert auto_split([5, 3]) == {"generator": (3,), "learner": (5,), "buffer": (3,)}  # the CPUs allowed, not 0..n-1
    assert load_config(None, []).run.affinity == "auto"
    cfg = load_config(None, ["run.affinity=auto"])
    split, line = auto_assignment(cfg, allowed={0, 1})
    assert split == auto_split([0, 1])
    assert line == "affinity: generator 0, learner 1, buffer 0 (auto on 2 CPUs; run.affinity=off to disable)"
    assert auto_assignment(cfg, allowed={0, 1, 2, 3})[1].startswith("affinity: generator 0-1, learner 2, buffer 3 ")
    assert auto_assignment(cfg, allowed={0})[0] is None
    split, line = auto_assignment(cfg, allowed=range(8))
    assert split is None and "8 CPUs > 4" in line
    # A split the config cannot take (two learner ranks on one CPU) pins nothing rather than failing the run.
    split, line = auto_assignment(load_config(None, ["run.affinity=auto", "learner.nproc=2"]), allowed={0, 1})
    assert split is None and "learner.nproc=2" in line


def test_explicit_cpus_win_and_off_pins_nothing(tmp_path, monkeypatch, capsys):
    split, line = auto_assignment(load_config(None, ["run.affinity=auto", "learner.cpus=1"]), allowed={0, 1})
    assert split is None and line == "affinity: generator any, learner 1, buffer any (from generator/learner/buffer.cpus)"
    split, line = auto_assignment(load_config(None, ["run.affinity=off"]), allowed={0, 1})
    assert split is None and line == "affinity: none (run.affinity=off)"
    # The launcher writes its choice into the config its children read, and prints it.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    for overrides, want in (([], ("0", "1", "0")), (["run.affinity=off"], ("", "", "")),
                            (["generator.cpus=1"], ("1", "", ""))):
        launcher = Launcher(load_config(None, [f"run.dir={tmp_path}", *overrides]))
        launcher._pin_roles()
        assert tuple(getattr(launcher.cfg, role).cpus for role in ("generator", "learner", "buffer")) == want
        assert capsys.readouterr().out.startswith("affinity: ")


# A child that starts a grandchild and reports torch's thread count, as the launcher's roles do.
TREE = ("import subprocess, sys, time\n"
        "kid = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "import torch\n"
        "print('threads', torch.get_num_threads(), flush=True)\n"
        "time.sleep(60)\n")


def _spawned_tree(launcher: Launcher, name: str, timeout_s: float = 60) -> int:
    """Waits until the launcher's child `name` has started its own child and reported; its pid."""
    deadline = time.time() + timeout_s
    log = launcher.run_dir / "logs" / f"{name}.log"
    while time.time() < deadline:
        grand = psutil.Process(launcher.children[name].pid).children()
        if grand and log.exists() and "threads" in log.read_text():
            return grand[0].pid
        time.sleep(0.1)
    raise AssertionError(f"{name} did not start its child")


@needs_two
def test_launcher_pins_each_role_tree_and_its_redis(tmp_path, monkeypatch):
    gen_cpus, learn_cpu = (ALLOWED[0], ALLOWED[1]), ALLOWED[-1]
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # the launcher's environment; a pinned role overrides it
    cfg = load_config(None, [f"run.dir={tmp_path}", f"generator.cpus={format_cpus(gen_cpus)}",
                             f"learner.cpus={learn_cpu}", f"buffer.cpus={learn_cpu}"])
    launcher = Launcher(cfg)
    try:
        for role in ("generator", "learner", "buffer"):
            launcher._spawn(role, [sys.executable, "-c", TREE], role=role)
        launcher._spawn("unpinned", [sys.executable, "-c", TREE])
        for role, want in (("generator", set(gen_cpus)), ("learner", {learn_cpu}), ("buffer", {learn_cpu}),
                           ("unpinned", set(ALLOWED))):
            grandchild = _spawned_tree(launcher, role)
            assert cpus_allowed(launcher.children[role].pid) == want, role
            assert cpus_allowed(grandchild) == want, f"{role}'s child did not inherit the mask"
        env = {r: environ(launcher.children[r].pid) for r in launcher.children}
        assert env["generator"]["VLLM_CPU_OMP_THREADS_BIND"] == format_cpus(gen_cpus)
        assert env["generator"]["OMP_NUM_THREADS"] == "2"
        assert env["learner"]["OMP_NUM_THREADS"] == "1"
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env["unpinned"] and env["unpinned"]["OMP_NUM_THREADS"] == "7"
        logs = {r: (tmp_path / "tiny" / "logs" / f"{r}.log").read_text() for r in ("generator", "learner")}
        assert "threads 2" in logs["generator"] and "threads 1" in logs["learner"]  # torch sized to the CPUs
        redis = LocalRedis(tmp_path / "redis", cpus=(learn_cpu,)).start()
        try:
            assert cpus_allowed(redis.proc.pid) == {learn_cpu}
        finally:
            redis.stop()
    finally:
        launcher.teardown()


@needs_two
def test_a_role_started_on_its_own_pins_itself(tmp_path, redis_server):
    """`asyncrl buffer` launched unpinned (as Slurm or a benchmark does) applies buffer.cpus itself."""
    cpu = ALLOWED[-1]
    from asyncrl.protocol.keys import Keys, connect

    keys, client = Keys("pin"), connect(redis_server.url)
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "buffer", f"run.dir={tmp_path}", "run.name=pin",
                             f"buffer.redis_url={redis_server.url}", f"buffer.cpus={cpu}",
                             "logging.prometheus=false"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not client.exists(keys.ingest_addr) and time.time() < deadline:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        assert client.exists(keys.ingest_addr), "the buffer did not come up"
        assert cpus_allowed(proc.pid) == {cpu}
        threads = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert all(cpus_allowed(t) == {cpu} for t in threads), "every thread of the role is pinned"
    finally:
        client.set(keys.stop, "1")
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
@needs_two
def test_a_pinned_run_keeps_vllm_and_torchrun_on_their_cpus(tmp_path, tiny_model):
    """A real `asyncrl run` (vLLM CPU engine, torchrun learner): every descendant of each role, and
    every thread of vLLM's engine core (where the model runs), runs on that role's CPU, with one
    OpenMP thread for its one CPU."""
    gen_cpu, learn_cpu = ALLOWED[0], ALLOWED[-1]
    run_dir = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", "run.max_steps=30", f"run.dir={run_dir}",
                             f"model.path={tiny_model}", f"generator.cpus={gen_cpu}", f"learner.cpus={learn_cpu}",
                             f"buffer.cpus={learn_cpu}", "logging.prometheus=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    metrics = run_dir / "tiny" / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        assert metrics.exists(), "no step within the deadline"
        seen = {}
        for p in psutil.Process(proc.pid).children(recursive=True):
            try:
                seen[p.pid] = (" ".join(p.cmdline()), cpus_allowed(p.pid), environ(p.pid))
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                continue
        roles = {"generator": gen_cpu, "learner": learn_cpu, "buffer": learn_cpu, "redis-server": learn_cpu}
        by_role: dict[str, list] = {r: [] for r in roles}
        for pid, (cmd, cpus, env) in seen.items():
            role = ("redis-server" if "redis-server" in cmd else "generator" if "VLLM_CPU_OMP_THREADS_BIND" in env
                    and env["VLLM_CPU_OMP_THREADS_BIND"] != "nobind" else
                    "learner" if "torch.distributed.run" in cmd or "asyncrl.launch.listen" in cmd or "RANK" in env else
                    "buffer" if " buffer " in f"{cmd} " else None)
            if role:
                by_role[role].append(pid)
                assert cpus == {roles[role]}, (role, cmd, cpus)
        # The generator and vLLM's engine core, which runs the one worker inside it (uni executor).
        cores = [pid for pid in by_role["generator"] if "VLLM::EngineCore" in seen[pid][0]]
        assert len(cores) == 1 and len(by_role["generator"]) >= 2, by_role
        assert len(by_role["learner"]) >= 2 and by_role["buffer"] and by_role["redis-server"], by_role
        for pid in by_role["generator"] + by_role["learner"]:  # threads too, not only the main thread
            want = gen_cpu if pid in by_role["generator"] else learn_cpu
            threads = thread_cpus(pid)
            assert threads and all(cpus == {want} for cpus in threads), seen[pid][0]
        ranks = [pid for pid in by_role["learner"] if "RANK" in seen[pid][2]]
        assert ranks and all(seen[pid][2]["OMP_NUM_THREADS"] == "1" for pid in ranks)  # torch threads = CPUs
        # The engine core runs the model's OpenMP threads: one, for the generator's one CPU.
        assert seen[cores[0]][2]["OMP_NUM_THREADS"] == "1", seen[cores[0]][2]
        row = json.loads(metrics.read_text().splitlines()[0])
        assert row["tokens"] > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            from asyncrl.launch.launcher import kill_tree

            kill_tree(proc.pid, 9)
