"""Generator teardown: vLLM's own shutdown can raise (its kill_process_tree races the engine core's
SIGKILL of the same worker, and psutil raises NoSuchProcess); VllmEngine.shutdown then logs it and
kills what is left of the engine's processes itself, so a generator that drained cleanly exits 0."""

import multiprocessing as mp
import time

import psutil

from asyncrl.launch.leaving import child_pids, kill_children
from generators.vllm_engine import VllmEngine


def _parent_of_a_sleeper():
    child = mp.get_context("spawn").Process(target=time.sleep, args=(300,))
    child.start()
    child.join()


def _tree():
    """A child that has a child of its own, as the engine core has its worker."""
    proc = mp.get_context("spawn").Process(target=_parent_of_a_sleeper)
    proc.start()
    deadline = time.monotonic() + 60
    while not psutil.Process(proc.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc, psutil.Process(proc.pid).children()[0].pid


def test_kill_children_kills_the_whole_tree_and_keeps_the_resource_tracker():
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    tracker = resource_tracker._resource_tracker._pid
    before, before_child = _tree()  # there before the engine: kept
    keep = child_pids()
    proc, grandchild = _tree()
    killed = kill_children(keep)
    assert proc.pid in killed and grandchild in killed and before.pid not in killed
    _gone(proc.pid)
    _gone(grandchild)
    assert tracker is None or psutil.pid_exists(tracker), "the resource tracker must be left alone"
    assert before.is_alive(), "a process that was there before the engine must be left alone"
    psutil.Process(before_child).kill()
    before.kill()
    before.join(5)


def _gone(pid: int) -> None:
    """Dead (gone or a zombie: the grandchild's parent was killed too) within 5 s."""
    deadline = time.monotonic() + 5
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"pid {pid} survived"
        time.sleep(0.05)


class _RacingEngine:
    """The failure seen in CI: vLLM's shutdown raised from psutil while its processes still ran."""

    def __init__(self):
        self.proc, self.worker = _tree()

    def shutdown(self, timeout=None):
        raise psutil.NoSuchProcess(self.worker, name="VLLM::Worker")


def test_engine_shutdown_never_raises_and_leaves_no_engine_process(caplog):
    engine = VllmEngine.__new__(VllmEngine)
    engine._children_before = child_pids()
    engine.engine = racing = _RacingEngine()
    engine.shutdown()
    assert "vLLM engine shutdown raised" in caplog.text
    _gone(racing.proc.pid)
    _gone(racing.worker)
    assert not hasattr(engine, "engine")


_ROLE = """
import multiprocessing as mp
import time

from asyncrl.launch.leaving import Leaving

if __name__ == "__main__":
    child = mp.get_context("spawn").Process(target=time.sleep, args=(300,))
    child.start()
    Leaving("role", "role.drain_timeout_s", 0.5, lambda: None).install()  # a stop that never finishes
    print(child.pid, flush=True)
    time.sleep(300)
"""


def test_a_role_forced_out_past_its_timeout_takes_its_children_with_it(tmp_path):
    import signal
    import subprocess
    import sys

    from asyncrl.launch.leaving import FORCED_EXIT

    script = tmp_path / "role.py"
    script.write_text(_ROLE)
    role = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(role.stdout.readline())
        assert psutil.pid_exists(child)
        t0 = time.monotonic()
        role.send_signal(signal.SIGTERM)
        assert role.wait(timeout=10) == FORCED_EXIT
        assert time.monotonic() - t0 < 5
        _gone(child)  # not orphaned: it would sleep on for five minutes
    finally:
        role.kill()
