"""Both generation backends implement generators/engines.py `Engine` exactly: the same methods,
the same parameters in the same order, coroutine where the protocol has one."""

import inspect
import os

import pytest

from generators.engines import Engine
from generators.hf_engine import HfEngine
from generators.vllm_engine import VllmEngine

METHODS = ("generate_group", "join", "update_weights", "idle", "shutdown")


@pytest.mark.parametrize("impl", [VllmEngine, HfEngine], ids=lambda c: c.__name__)
def test_backend_matches_the_engine_protocol(impl):
    for name in METHODS:
        want, got = getattr(Engine, name), getattr(impl, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), name
        want_params = [(p.name, p.kind, p.default) for p in inspect.signature(want).parameters.values()]
        got_params = [(p.name, p.kind, p.default) for p in inspect.signature(got).parameters.values()]
        assert got_params == want_params, f"{impl.__name__}.{name}"
    assert "num_workers" in inspect.getsource(impl.__init__)  # the protocol's attribute, set by every backend


def test_generator_uses_only_the_protocol():
    """The generator process reaches its engine only through the protocol's names (`self.engine` in
    generators/main.py, `gen.engine` in the parts it ties)."""
    import ast
    from pathlib import Path

    folder = Path(__file__).parents[1] / "generators"
    parts = ("main", "heartbeat", "weights", "leasing", "groups", "leave", "evaluation", "drain")
    trees = [ast.parse((folder / f"{name}.py").read_text()) for name in parts]
    used = {n.attr for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "engine"
            and isinstance(n.value.value, ast.Name) and n.value.value.id in ("self", "gen")}
    assert used and used <= set(METHODS) | {"num_workers"}, used


@pytest.mark.parametrize("tp, preset, want", [(1, None, "0"), (2, None, "1"), (1, "1", "1")])
def test_cpu_build_runs_a_single_worker_inside_the_engine_core(monkeypatch, tp, preset, want):
    """One worker: vLLM's uni executor in the engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0), not
    a third process; tensor parallelism keeps the multiprocessing executor; a value already in the
    environment is the user's and stays."""
    from asyncrl.config import load_config
    from generators.vllm_engine import cpu_env_defaults

    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                 "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    if preset is not None:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", preset)
    cpu_env_defaults(load_config(None, [f"generator.tensor_parallel_size={tp}"]))
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == want
