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
            # The Qwen2.5-0.5B body, its completions within the engine's context and the model's positions.
            assert cfg.tiny_shape() == {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2,
                                        "intermediate_size": 4864}
            assert cfg.data.max_len + 1 + cfg.generator.max_tokens <= cfg.generator.max_model_len
            assert cfg.weights.backend == "auto" and not cfg.generator.enforce_eager
            assert cfg.learner.mixed_precision.param_dtype == "bfloat16" == cfg.model.dtype == cfg.generator.dtype
    assert load_config(None, []).tiny_shape() == {"hidden_size": 128, "num_layers": 2, "num_heads": 2,
                                                  "num_kv_heads": 1, "intermediate_size": 256}
    with pytest.raises(ConfigError, match=r"model\.tiny\.hidden_size .* multiple of 64"):
        load_config(None, ["model.tiny.hidden_size=100"])
    with pytest.raises(ConfigError, match=r"multiple of model\.tiny\.num_kv_heads"):
        load_config(None, ["model.tiny.hidden_size=512", "model.tiny.num_kv_heads=3"])
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


def _section(schema: dict, name: str) -> dict:
    """A section of pydantic's schema: the tree's properties point into `$defs`."""
    return schema["$defs"][schema["properties"][name]["$ref"].rsplit("/", 1)[-1]]


def test_config_schema_describes_every_field_and_validates_the_shipped_configs(tmp_path):
    """`asyncrl config schema`: pydantic's JSON Schema of the tree, whose types, choices and declared
    ranges accept every shipped config and refuse what load_config refuses (a range, a choice, a type,
    an unknown key)."""
    import json

    import jsonschema
    import yaml

    from asyncrl.config import Config, config_schema, to_dict

    out = tmp_path / "schema.json"
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "schema", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    schema = json.loads(out.read_text())
    assert schema == json.loads(json.dumps(config_schema()))
    assert schema["$schema"].endswith("2020-12/schema")
    assert {k: v for k, v in schema.items() if k != "$schema"} == json.loads(json.dumps(Config.model_json_schema()))
    lr = _section(schema, "learner")["properties"]["lr"]
    assert lr["type"] == "number" and lr["exclusiveMinimum"] == 0 and lr["default"] == 5e-4
    ports = _section(schema, "buffer")["properties"]["ingest_port"]
    assert (ports["minimum"], ports["maximum"]) == (0, 65535)
    assert _section(schema, "learner")["properties"]["minibatches"]["minimum"] == 1
    run = _section(schema, "run")["properties"]
    assert run["mode"]["enum"] == ["async", "sync"] and run["affinity"]["enum"] == ["auto", "off"]
    assert "stall" in run["stall_timeout_s"]["description"]
    assert _section(schema, "learner")["additionalProperties"] is False
    validator = jsonschema.Draft202012Validator(schema)
    for path in sorted(REPO_CONFIGS.glob("*.yaml")):
        validator.validate(yaml.safe_load(path.read_text()) or {})
        validator.validate(json.loads(json.dumps(to_dict(load_config(path)))))
    for bad in ({"learner": {"lr": -1.0}}, {"run": {"mode": "sometimes"}}, {"generator": {"n": "four"}},
                {"learner": {"lrr": 1e-6}}, {"buffer": {"ingest_port": 65536}}, {"run": {"affinity": "on"}}):
        assert not validator.is_valid(bad), bad


def test_renamed_keys_still_load_with_one_line_naming_the_new_key(tmp_path, caplog):
    """A key moved into a sub-section (`model.tiny_hidden_size` -> `model.tiny.hidden_size`) is read under
    its old name from a file and from an override for one release, with one deprecation line each."""
    from asyncrl.config import RENAMED_KEYS, Config, _said_renamed, dump_yaml

    _said_renamed.clear()
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  tiny_hidden_size: 256\n  tiny_warm_start_steps: 5\n"
                    "algorithm:\n  loss: sapo\n  sapo_tau_pos: 2.0\n  cov:\n    lb: 0.5\n")
    with caplog.at_level("WARNING", logger="asyncrl.config"):
        cfg = load_config(path, ["algorithm.dro_beta=0.3", "algorithm.mis_high=3"])
    assert cfg.model.tiny.hidden_size == 256 and cfg.model.tiny.warm_start_steps == 5
    assert cfg.algorithm.sapo.tau_pos == 2.0 and cfg.algorithm.cov.lb == 0.5
    assert cfg.algorithm.dro.beta == 0.3 and cfg.algorithm.mis.high == 3.0
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 5 and all("\n" not in line for line in lines), lines
    assert any("model.tiny_hidden_size" in line and "use model.tiny.hidden_size" in line for line in lines)
    assert any("algorithm.dro_beta" in line and "use algorithm.dro.beta" in line for line in lines)
    assert load_config(None, ["model.tiny_num_layers=3"]).model.tiny.num_layers == 3
    assert "tiny_hidden_size" not in dump_yaml(cfg) and "sapo_tau_pos" not in dump_yaml(cfg)
    for new in RENAMED_KEYS.values():  # every new key is a field of the tree
        node = Config()
        for part in new.split("."):
            node = getattr(node, part)


def test_config_check_is_one_line_and_exit_2():
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", "learner.lr=-2"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip() == "asyncrl: config error: learner.lr must be > 0, got -2.0"
    done = subprocess.run([sys.executable, "-m", "asyncrl", "config", "check", "run.max_steps=3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "config ok" in done.stdout, done.stderr


def _one_line_error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_overrides_are_coerced_by_the_field_type():
    """Text fields (and choices among texts) keep the text as typed; numbers and booleans take the YAML
    reading of the text and pydantic's lax coercion by the field's type; a value that is not of the
    type is refused in one line naming the key."""
    cfg = load_config(None, ["data.alphabet=0123", "run.name=1e3", "deploy.slurm_time=010", "run.affinity=off",
                             "buffer.appendfsync=no", "run.max_steps=1e3", "generator.enforce_eager=yes",
                             "learner.lr=1", "deploy.slurm_extra=--account=rl,--qos=high"])
    assert cfg.data.alphabet == "0123" and cfg.run.name == "1e3" and cfg.deploy.slurm_time == "010"
    assert cfg.run.affinity == "off" and cfg.buffer.appendfsync == "no"  # YAML would read both as false
    assert cfg.run.max_steps == 1000 and type(cfg.run.max_steps) is int
    assert cfg.generator.enforce_eager is True and cfg.learner.lr == 1.0 and type(cfg.learner.lr) is float
    assert cfg.deploy.slurm_extra == ["--account=rl", "--qos=high"]
    assert _one_line_error(["learner.lr=abc"]) == "learner.lr: expected a number, got 'abc'"
    assert _one_line_error(["generator.max_tokens=abc"]) == "generator.max_tokens: expected an integer, got 'abc'"
    assert _one_line_error(["generator.enforce_eager=2"]) == "generator.enforce_eager: expected true/false, got 2"
    assert _one_line_error(["run.affinity=on"]) == "run.affinity: 'on' is not one of ['auto', 'off']"
    assert _one_line_error(["learner=3"]) == "learner: expected a mapping, got 3"


def test_optional_override_text():
    """`null` (YAML's null) is None for an optional field; other text is read by the inner type."""
    from asyncrl.config import _override_value

    assert _override_value("null", int | None) is None and _override_value("~", str | None) is None
    assert _override_value("7", int | None) == 7 and _override_value("none", str | None) == "none"
    assert _override_value("0123", str | None) == "0123"


def test_yaml_values_are_checked_strictly(tmp_path):
    """A YAML integer field takes an integer (not 2.0 or "2"), a boolean true/false (not 1); a number
    in a text field is its text and a comma-separated string in a list field its items."""
    path = tmp_path / "c.yaml"

    def load(text: str):
        path.write_text(text)
        return load_config(path)

    cfg = load("run: {name: 7}\nlearner: {lr: 1}\nlogging: {backends: 'jsonl,tensorboard'}\n")
    assert cfg.run.name == "7" and cfg.learner.lr == 1.0 and cfg.logging.backends == ["jsonl", "tensorboard"]
    for text, message in (("run: {max_steps: 2.0}", "run.max_steps: expected an integer, got 2.0"),
                          ("run: {max_steps: '3'}", "run.max_steps: expected an integer, got '3'"),
                          ("generator: {enforce_eager: 1}", "generator.enforce_eager: expected true/false, got 1"),
                          ("run: {name: true}", "run.name: expected a string, got True"),
                          ("learner: {minibatches: 0}", "learner.minibatches must be >= 1, got 0"),
                          ("run: 3", "run: expected a mapping, got 3"),
                          ("learner: {lora: {rankk: 4}}", "unknown config key 'learner.lora.rankk'; did you mean "
                                                          "'learner.lora.rank'?"),
                          ("genrator: {n: 4}", "unknown config key 'genrator'; did you mean 'generator'?")):
        with pytest.raises(ConfigError) as e:
            load(text)
        assert str(e.value) == message, text


@pytest.mark.parametrize("key, inside, outside, message", [
    ("learner.minibatches", "1", "0", "learner.minibatches must be >= 1, got 0"),
    ("run.stall_timeout_s", "0", "-0.5", "run.stall_timeout_s must be >= 0, got -0.5"),
    ("learner.lr", "1e-9", "0", "learner.lr must be > 0, got 0.0"),
    ("generator.gpu_memory_utilization", "1", "1.01", "generator.gpu_memory_utilization must be > 0 and <= 1, got 1.01"),
    ("generator.gpu_memory_utilization", "0.01", "0", "generator.gpu_memory_utilization must be > 0 and <= 1, got 0.0"),
    ("buffer.ingest_port", "65535", "65536", "buffer.ingest_port must be >= 0 and <= 65535, got 65536"),
    ("learner.lora.dropout", "0", "1", "learner.lora.dropout must be >= 0 and < 1, got 1.0"),
    ("learner.min_lr_ratio", "1", "1.5", "learner.min_lr_ratio must be >= 0 and <= 1, got 1.5"),
    ("algorithm.is_cap", "1", "0.5", "algorithm.is_cap must be >= 1, got 0.5"),
])
def test_declared_ranges_at_and_beyond_their_bounds(key, inside, outside, message):
    value = load_config(None, [f"{key}={inside}"])
    for part in key.split("."):
        value = getattr(value, part)
    assert value == float(inside)
    assert _one_line_error([f"{key}={outside}"]) == message


def test_assignments_are_validated_and_configs_round_trip(tmp_path):
    """Call sites set fields (the launcher's redis_url); a wrong value is refused there too. The YAML
    snapshot of a resolved config (launch, Slurm, Ray) loads back to an equal config; copies and
    pickles are equal."""
    import copy
    import pickle

    from pydantic import ValidationError

    from asyncrl.config import dump_yaml

    cfg = load_config(None, ["data.alphabet=0123", "logging.backends=jsonl,tensorboard", "run.affinity=off"])
    cfg.buffer.redis_url = "redis://127.0.0.1:6379"
    with pytest.raises(ValidationError):
        cfg.learner.minibatches = 0
    with pytest.raises(ValidationError):
        cfg.learner.lrr = 1.0
    path = tmp_path / "snapshot.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(path) == cfg and "alphabet: '0123'" in path.read_text()
    assert copy.deepcopy(cfg) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
    assert load_config(None, []) != cfg
