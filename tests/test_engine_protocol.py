"""Both generation backends implement generators/engines.py `Engine` exactly: the same methods,
the same parameters in the same order, coroutine where the protocol has one."""

import inspect

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
    """The generator process reaches its engine only through the protocol's names."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parents[1] / "generators" / "main.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "engine" and isinstance(n.value.value, ast.Name) and n.value.value.id == "self"}
    assert used and used <= set(METHODS) | {"num_workers"}, used
