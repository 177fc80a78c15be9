"""One short demo run with `learner.compile=true`, then the run folder it leaves behind.

- Compiled layers: wrapping a layer (`torch.compile(layer)`) puts `_orig_mod.` into every parameter
  name the learner pushes, which the generator's model does not have; the layers are compiled in
  place, and every push must load into the real vLLM generator.
- After the run its redis-server is gone: `asyncrl status` and `asyncrl inspect` read the state the
  run folder saved (the AOF), say the run has ended, and `inspect` scores the trajectories with the
  weights the learner exported at the end.
"""

import json
import re
import subprocess
import sys
import time

import pytest
import yaml

STEPS = 3


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("finished")
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={STEPS}", "learner.compile=true"],
                       capture_output=True, text=True, timeout=900, cwd=cwd)
    return cwd, r


def _asyncrl(cwd, *argv):
    return subprocess.run([sys.executable, "-m", "asyncrl", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


@pytest.mark.slow
def test_compiled_learner_run_finishes_and_every_push_is_taken(finished):
    cwd, r = finished
    out = r.stdout[-3000:] + r.stderr[-5000:]
    assert r.returncode == 0, out
    run_dir = cwd / "runs" / "tiny"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["learner"]["compile"] is True
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["version"] == STEPS
    gen_log = (run_dir / "logs" / "generator-g0.log").read_text()
    assert "_orig_mod" not in gen_log + r.stderr, out
    # Version 0 comes with the first weight-group epoch, then one push a step, the last one included.
    loaded = [int(v) for v in re.findall(r"generator g0 now at version (\d+)", gen_log)]
    assert loaded == list(range(0, STEPS + 1)), (loaded, gen_log[-3000:])


@pytest.mark.slow
def test_status_of_a_finished_run_reads_its_run_folder(finished):
    cwd, r = finished
    assert r.returncode == 0
    s = _asyncrl(cwd, "status", "runs/tiny/config.yaml", "--once", "--json")
    assert s.returncode == 0, s.stderr[-3000:]
    assert "run 'tiny' has ended" in s.stderr and "runs/tiny/redis" in s.stderr, s.stderr
    snap = json.loads(s.stdout)
    assert snap["ended"] and snap["stopped"] and snap["stalls"] == []
    assert snap["learner"]["step"] == STEPS and snap["learner"]["version"] == STEPS
    assert any(e["kind"] == "learner_done" for e in snap["events"])
    # Without --once a finished run prints one snapshot and returns (there is nothing live to follow).
    s = _asyncrl(cwd, "status", "runs/tiny/config.yaml")
    assert s.returncode == 0 and "asyncrl run tiny (ended)" in s.stdout, s.stdout[-2000:] + s.stderr[-2000:]
    # The run folder is only read.
    assert not list((cwd / "runs" / "tiny" / "redis").glob("*.rdb"))


@pytest.mark.slow
def test_inspect_of_a_finished_run_uses_the_learners_final_weights(finished):
    cwd, r = finished
    assert r.returncode == 0

    def current(*extra):
        s = _asyncrl(cwd, "inspect", "runs/tiny/config.yaml", "-n", "4", "--samples", "4", "--json", *extra)
        assert s.returncode == 0, s.stderr[-3000:]
        assert "run 'tiny' has ended" in s.stderr, s.stderr
        out = json.loads(s.stdout)
        lps = [t["current_logprob"] for g in out["groups"] for x in g["samples"] for t in x["tokens"]]
        assert len(lps) > 10
        return out, lps

    default, default_lps = current()
    assert default["current_weights"] == "runs/tiny/hf-final"
    assert default["current_weights_are"] == f"the learner's final export, version {STEPS}"
    named, named_lps = current("--model", "runs/tiny/hf-final")
    assert named["current_weights_are"] == "--model" and named_lps == default_lps
    _, start_lps = current("--model", "runs/tiny/tiny-model")  # the starting weights score differently
    assert max(abs(a - b) for a, b in zip(start_lps, default_lps, strict=True)) > 0.01
    text = _asyncrl(cwd, "inspect", "runs/tiny/config.yaml", "-n", "1", "--samples", "1")
    assert "weights at runs/tiny/hf-final (the learner's final export" in text.stdout.replace("\n", ""), text.stdout


@pytest.mark.slow
def test_resume_of_the_finished_run_without_checkpoints_refuses_in_one_line(finished):
    """The demo writes no checkpoint (checkpoint.every=0): run.resume=true has nothing to go on from,
    and says so at once rather than starting a learner at version 0 that waits for a weight group."""
    cwd, r = finished
    assert r.returncode == 0
    t0 = time.monotonic()
    s = _asyncrl(cwd, "run", f"run.max_steps={STEPS}", "run.resume=true")
    took = time.monotonic() - t0
    # The launcher's INFO record of the redis-server it reopened, then the refusal.
    lines = [line for line in s.stderr.splitlines() if line.strip() and " INFO " not in line]
    assert s.returncode == 2 and took < 10, (took, s.stdout[-2000:], s.stderr[-3000:])
    assert len(lines) == 1, s.stderr[-3000:]
    assert f"reached version {STEPS}" in lines[0] and "no complete checkpoint" in lines[0], lines[0]
    assert "run.reset=true" in lines[0] and "run.name" in lines[0] and "checkpoint.every" in lines[0], lines[0]
    assert "started" not in s.stdout  # no role was spawned
    # The finished run is left as it was: its metrics and its ended state.
    rows = [json.loads(line) for line in (cwd / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
