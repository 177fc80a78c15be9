"""`learner.compile=true` end to end: the compiled learner's pushes load into a real vLLM generator.

Compiling a layer by wrapping it (`torch.compile(layer)`) puts `_orig_mod.` into every parameter name
the learner pushes, and the generator's model has no such names; the layers are compiled in place.
"""

import json
import re
import subprocess
import sys

import pytest
import yaml


@pytest.mark.slow
def test_compiled_learner_run_finishes_and_every_push_is_taken(tmp_path):
    steps = 3
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", f"run.max_steps={steps}", "learner.compile=true"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = r.stdout[-3000:] + r.stderr[-5000:]
    assert r.returncode == 0, out
    run_dir = tmp_path / "runs" / "tiny"
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["learner"]["compile"] is True
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert rows[-1]["version"] == steps
    gen_log = (run_dir / "logs" / "generator-g0.log").read_text()
    assert "_orig_mod" not in gen_log + r.stderr, out
    # Version 0 comes with the first weight-group epoch, then one push a step, the last one included.
    loaded = [int(v) for v in re.findall(r"generator g0 now at version (\d+)", gen_log)]
    assert loaded == list(range(0, steps + 1)), (loaded, gen_log[-3000:])
