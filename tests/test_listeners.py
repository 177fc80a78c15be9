"""Nothing a run starts listens beyond loopback: every listening socket of a live `asyncrl run`
(redis-server, buffer ingest, /metrics, the weight group's store, torchrun's rendezvous, the
learner ranks' and vLLM's own process groups) is on 127.0.0.1; and Ctrl-C ends the whole run, every
process it started, in under 5 s without a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.observe.metrics import complete_rows
from asyncrl.protocol.tcpstore import master_store


def test_master_store_listens_on_the_given_host_only():
    store = master_store("127.0.0.1", 0, wait_for_workers=False)
    mine = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert any(c.laddr.port == store.port for c in mine)
    assert all(c.laddr.ip == "127.0.0.1" for c in mine if c.laddr.port == store.port), mine


def _listeners(procs) -> list[tuple[str, str, int]]:
    out = []
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    out.append((" ".join(p.cmdline()[:4]), c.laddr.ip, c.laddr.port))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def _rows(run_dir: Path) -> list[dict]:
    return complete_rows(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_a_live_run_listens_on_loopback_only_and_ctrl_c_ends_it_in_5_s(tmp_path, tiny_model):
    run_dir = tmp_path / "runs" / "tiny"
    launcher = subprocess.Popen([sys.executable, "-m", "asyncrl", "run", f"run.dir={tmp_path / 'runs'}",
                                 "run.max_steps=1000", f"model.path={tiny_model}", "run.stall_timeout_s=0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree = []
    try:
        deadline = time.time() + 600
        while len(_rows(run_dir)) < 2 and time.time() < deadline:  # a weight sync has happened
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            time.sleep(0.5)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        assert len(tree) >= 4, "expected redis, buffer, generator (+ engine core) and learner (+ rank)"
        listening = _listeners(tree)
        roles = {cmd for cmd, _, _ in listening}
        assert any("redis-server" in r for r in roles) and len(listening) >= 4, listening
        wide = [x for x in listening if x[1] not in ("127.0.0.1", "::1")]
        assert not wide, f"listening beyond loopback: {wide}"
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
        seconds = time.monotonic() - t0
        assert launcher.returncode == 130, err[-3000:]  # as a shell reports Ctrl-C
        alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [(p.pid, p.cmdline()[:4]) for p in alive]
        (tmp_path / "stderr.txt").write_text(err)
        assert "Traceback" not in err, err[-3000:]
        assert seconds < 5.0, f"Ctrl-C took {seconds:.1f}s"
    finally:
        from asyncrl.launch.launcher import kill_tree

        for p in [launcher, *tree]:
            kill_tree(p.pid, signal.SIGKILL)  # a failed assertion leaves nothing running
