"""The door: every bad input at start is one clear line and exit 2, with nothing left running;
options and overrides in any order on every command (the README's lines, as written)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.launch.cli import parse_args

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("override, message", [
    ("learner.minibatches=0", "learner.minibatches must be >= 1, got 0"),
    ("learner.ppo_epochs=0", "learner.ppo_epochs must be >= 1, got 0"),
    ("learner.lr=-1", "learner.lr must be > 0, got -1.0"),
    ("weights.join_timeout_s=-1", "weights.join_timeout_s must be > 0, got -1.0"),
    ("generator.gpu_memory_utilization=1.5", "generator.gpu_memory_utilization must be > 0 and <= 1, got 1.5"),
    ("buffer.ingest_port=70000", "buffer.ingest_port must be >= 0 and <= 65535, got 70000"),
])
def test_declared_bounds_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [override])


def _asyncrl(*argv, timeout=60):
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "asyncrl", *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)
    return proc, time.monotonic() - t0


def _one_line(proc, needle: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_bad_inputs_at_the_door_are_one_line_exit_2_and_start_nothing(tmp_path):
    runs = f"run.dir={tmp_path / 'runs'}"
    proc, _ = _asyncrl("run", runs, "learner.lr=-1")
    _one_line(proc, "learner.lr must be > 0")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n")
    proc, _ = _asyncrl("run", str(bad))
    _one_line(proc, f"config file {bad} is not valid YAML at line 3")
    proc, seconds = _asyncrl("run", runs, f"model.path={tmp_path / 'no-such-model'}")
    _one_line(proc, f"model.path: {tmp_path / 'no-such-model'} does not exist")
    assert seconds < 10
    proc, _ = _asyncrl("run", runs, "buffer.redis_url=redis://127.0.0.1:1/0")
    _one_line(proc, "cannot reach Redis at redis://127.0.0.1:1/0")
    proc, _ = _asyncrl("generator", "configs/tiny.yaml", "--id", "g0", runs, "buffer.redis_url=redis://127.0.0.1:1/0")
    _one_line(proc, "cannot reach Redis at redis://127.0.0.1:1/0")
    # Nothing started: no run directory (so no local redis-server, no child logs).
    assert not (tmp_path / "runs").exists()


def test_redis_password_missing_or_wrong_is_named(tmp_path):
    from asyncrl.launch.redis_server import LocalRedis
    from asyncrl.protocol.security import write_secret

    with LocalRedis(tmp_path / "redis", password="s3cret") as server:
        url = server.address_url  # no password in the URL
        proc, _ = _asyncrl("buffer", "configs/tiny.yaml", f"buffer.redis_url={url}", f"run.dir={tmp_path}")
        _one_line(proc, f"Redis at {url} requires a password: set deploy.redis_password_file")
        wrong = write_secret(tmp_path / "wrong", "not-it")
        proc, _ = _asyncrl("buffer", "configs/tiny.yaml", f"buffer.redis_url={url}",
                           f"deploy.redis_password_file={wrong}", f"run.dir={tmp_path}")
        _one_line(proc, f"Redis at {url} refused the password in deploy.redis_password_file")
        proc, _ = _asyncrl("buffer", "configs/tiny.yaml", f"buffer.redis_url={url}",
                           f"deploy.redis_password_file={tmp_path / 'absent'}", f"run.dir={tmp_path}")
        _one_line(proc, f"secret file {tmp_path / 'absent'} does not exist")


def _readme_commands() -> list[list[str]]:
    cmds = []
    text = (REPO / "README.md").read_text()
    variables = dict(re.findall(r'^(\w+)="(.*)"$', text, re.M))  # shell variables a block sets
    for line in text.splitlines():
        line = re.sub(r"\$(\w+)", lambda v: variables.get(v.group(1), v.group(0)), line)
        line = re.split(r"\s\d?>", line)[0]  # an output redirection (and the `&` after it)
        m = re.match(r"^asyncrl (buffer|generator|learner|run|submit|scale)\b(.*?)(#.*)?$", line.strip())
        if m:
            cmds.append(shlex.split(f"{m.group(1)} {m.group(2)}"))
    return cmds


def test_readme_lines_parse_with_options_and_overrides_in_any_order():
    cmds = _readme_commands()
    assert len(cmds) >= 10
    for argv in cmds:
        args = parse_args(argv)
        given = [a for a in argv if "=" in a and not a.startswith("-")]
        assert given == [*([args.config] if args.config and "=" in args.config else []), *args.overrides], argv
    args = parse_args(["generator", "configs/tiny.yaml", "--id", "g0", "buffer.redis_url=redis://h:1/0", "run.seed=3"])
    assert (args.config, args.id, args.overrides) == ("configs/tiny.yaml", "g0", ["buffer.redis_url=redis://h:1/0",
                                                                                  "run.seed=3"])
    args = parse_args(["submit", "ray", "configs/tiny.yaml", "--address", "http://h:8265", "run.max_steps=6"])
    assert args.overrides == ["run.max_steps=6"] and args.address == "http://h:8265"
    args = parse_args(["scale", "--generators", "+1", "configs/tiny.yaml", "run.name=x"])
    assert (args.config, args.overrides, args.generators) == ("configs/tiny.yaml", ["run.name=x"], "+1")
    with pytest.raises(SystemExit):
        parse_args(["generator", "configs/tiny.yaml", "--id", "g0", "stray"])


def test_overrides_after_options_take_effect():
    proc, _ = _asyncrl("generator", "configs/tiny.yaml", "--id", "g0", "--print-config", "generator.n=3",
                       "buffer.redis_url=redis://h:1/0")
    assert proc.returncode == 0, proc.stderr
    assert "n: 3" in proc.stdout and "redis_url: redis://h:1/0" in proc.stdout
