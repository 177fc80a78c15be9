import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import REPO_CONFIGS, ConfigError, load_config


def test_misspelled_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'learner\.lrr'; did you mean 'learner\.lr'"):
        load_config(None, ["learner.lrr=1e-6"])


def test_misspelled_section_and_bad_values_fail_with_the_dotted_path():
    with pytest.raises(ConfigError, match="did you mean 'generator'"):
        load_config(None, ["generatr.n=4"])
    with pytest.raises(ConfigError, match="generator.n: expected an integer"):
        load_config(None, ["generator.n=four"])
    with pytest.raises(ConfigError, match="weights.mode: 'sometimes' is not one of"):
        load_config(None, ["weights.mode=sometimes"])
    with pytest.raises(ConfigError, match="generator.n must be > 1"):
        load_config(None, ["generator.n=1"])
    with pytest.raises(ConfigError, match="learner.batch_groups .* divisible by learner.nproc"):
        load_config(None, ["learner.nproc=3", "learner.batch_groups=8"])


def test_overrides_are_typed():
    cfg = load_config(None, ["learner.lr=1e-6", "run.max_steps=3", "generator.enforce_eager=false"])
    assert cfg.learner.lr == 1e-6 and cfg.run.max_steps == 3 and cfg.generator.enforce_eager is False


def test_override_text_is_read_by_the_field_type():
    """A string field keeps the text as typed (YAML would read 0123 as the octal 83 and 1e3 as 1000.0);
    a number field still reads numbers and refuses text, naming the key; quotes, null and lists work."""
    cfg = load_config(None, ["data.alphabet=0123", "run.name=1e3", "model.path=true", "learner.lr=2e-5",
                             "run.max_steps=0x10", 'data.arith_prompt="{a} {op} {b} ="', "logging.backends=jsonl,tensorboard"])
    assert cfg.data.alphabet == "0123" and cfg.run.name == "1e3" and cfg.model.path == "true"
    assert cfg.data.arith_prompt == "{a} {op} {b} =" and cfg.learner.lr == 2e-5 and cfg.run.max_steps == 16 and cfg.logging.backends == ["jsonl", "tensorboard"]
    assert load_config(None, ["run.name='quoted'"]).run.name == "quoted"
    for text in ("[2,3]", "2,3", "[2, 3]"):  # a float list, in YAML flow or comma form
        cfg = load_config(None, ["algorithm.rollout_rs=token_k1,token_k2", f"algorithm.rollout_rs_threshold={text}"])
        assert cfg.algorithm.rollout_rs_threshold == [2.0, 3.0], text
    with pytest.raises(ConfigError, match="learner.lr: expected a number, got 'abc'"):
        load_config(None, ["learner.lr=abc"])
    with pytest.raises(ConfigError, match="run.max_steps: expected an integer, got 1.5"):
        load_config(None, ["run.max_steps=1.5"])


@pytest.mark.parametrize("path", sorted(REPO_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    load_config(path)


def test_benchmark_presets_load_and_tiny_shapes_are_checked():
    """Every preset of benchmarks/async_vs_sync.py validates (gpu-copy is run on a GPU box, so its
    config must be right before it gets there); the default tiny shape is the one tests have used."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from async_vs_sync import PRESETS

    for name, overrides in PRESETS.items():
        cfg = load_config(None, [*overrides, "data.path=train.parquet"])
        if name == "gpu-copy":
            assert cfg.tiny_shape() == {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 2,
                                        "intermediate_size": 1024}
            assert cfg.weights.backend == "gloo" and not cfg.generator.enforce_eager
            assert cfg.learner.mixed_precision.param_dtype == "bfloat16" == cfg.model.dtype == cfg.generator.dtype
    assert load_config(None, []).tiny_shape() == {"hidden_size": 128, "num_layers": 2, "num_heads": 2,
                                                  "num_kv_heads": 1, "intermediate_size": 256}
    with pytest.raises(ConfigError, match="model.tiny_hidden_size .* multiple of 64"):
        load_config(None, ["model.tiny_hidden_size=100"])
    with pytest.raises(ConfigError, match="multiple of model.tiny_num_kv_heads"):
        load_config(None, ["model.tiny_hidden_size=512", "model.tiny_num_kv_heads=3"])
    with pytest.raises(ConfigError, match="weights.backend: 'mpi' is not one of"):
        load_config(None, ["weights.backend=mpi"])


def test_cli_rejects_misspelled_key_at_start_and_help_is_fast():
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "learner.lrr=3"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "did you mean 'learner.lr'" in r.stderr
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "asyncrl", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "generator" in r.stdout
    assert time.perf_counter() - t0 < 1.0, "asyncrl --help must not import torch or vLLM"
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", "--print-config", "run.max_steps=7"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "max_steps: 7" in r.stdout


def test_config_schema_describes_every_field_and_validates_the_shipped_configs(tmp_path):
    """`asyncrl config schema`: a JSON Schema whose types, choices and declared ranges accept every
    shipped config and refuse what load_config refuses (a range, a choice, a type, an unknown key)."""
    import json

    import jsonschema
    import yaml

    from asyncrl.config import config_schema, to_dict

    out = tmp_path / "schema.json"
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "schema", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    schema = json.loads(out.read_text())
    assert schema == json.loads(json.dumps(config_schema()))
    lr = schema["properties"]["learner"]["properties"]["lr"]
    assert lr["type"] == "number" and lr["exclusiveMinimum"] == 0
    assert schema["properties"]["run"]["properties"]["mode"]["enum"] == ["async", "sync"]
    assert "stall" in schema["properties"]["run"]["properties"]["stall_timeout_s"]["description"]
    validator = jsonschema.Draft202012Validator(schema)
    for path in sorted(REPO_CONFIGS.glob("*.yaml")):
        validator.validate(yaml.safe_load(path.read_text()) or {})
        validator.validate(json.loads(json.dumps(to_dict(load_config(path)))))
    for bad in ({"learner": {"lr": -1.0}}, {"run": {"mode": "sometimes"}}, {"generator": {"n": "four"}},
                {"learner": {"lrr": 1e-6}}):
        assert not validator.is_valid(bad), bad


def test_config_check_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", "learner.lr=-2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == "asyncrl: config error: learner.lr must be > 0, got -2.0"
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", "run.max_steps=3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "config ok" in done.stdout, done.stderr
