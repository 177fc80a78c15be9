"""The import graph: no circles, a small core top level, role packages apart.

Every import that can run is an edge, those inside functions included: a circle closed by a deferred
import is still a circle, only hidden. Imports under `if TYPE_CHECKING:` never run and are not edges.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("asyncrl", "buffers", "generators", "learners")
ROLES = ("buffers", "generators", "learners")
MAX_TOP_LEVEL = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(nodes):
    """Every import statement that can run: at module level, in functions and classes, in if / try /
    with blocks; not under `if TYPE_CHECKING:`."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _imports(node.orelse)
        else:
            yield from _imports(ast.iter_child_nodes(node))


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere (relative imports resolved)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the submodule when there is one, else a name of pkg.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for target in targets:
                # `import a.b.c` runs a, a.b and a.b.c; the deepest project module is the edge.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle as [a, b, ..., a], or None; iterative depth-first search."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for root in sorted(graph):
        if state.get(root):
            continue
        path, stack = [root], [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_find_cycle_on_synthetic_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": set(), "a": {"b"}, "b": {"b2", "a"}, "b2": set()}) == ["a", "b", "a"]


def test_graph_reads_imports_inside_functions_but_not_type_checking_ones(tmp_path):
    mods = {"p.a": tmp_path / "a.py", "p.b": tmp_path / "b.py", "p": tmp_path / "__init__.py"}
    mods["p"].write_text("")
    mods["p.a"].write_text("from . import b\nfrom p.b import x\n")
    mods["p.b"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import a\n")
    graph = import_graph(mods)
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == set()
    mods["p.b"].write_text("class C:\n    def f(self):\n        if True:\n            import p.a\n")
    assert find_cycle(import_graph(mods)) == ["p.a", "p.b", "p.a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph(modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_core_top_level_is_small():
    top = sorted(p.name for p in (REPO / "asyncrl").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules directly under asyncrl/: {top}"


def test_core_subpackages_say_what_they_hold():
    for init in sorted((REPO / "asyncrl").glob("*/__init__.py")):
        first = init.read_text().lstrip().splitlines()[:1]
        line = first[0] if first else ""
        opens = line.startswith("#") or (line.startswith('"""') and line.endswith('"""') and len(line) > 6)
        assert opens, f"{init.relative_to(REPO)} must open with a one-line docstring or comment"


def test_role_packages_import_only_the_core():
    for name, edges in import_graph(modules()).items():
        role = name.split(".")[0]
        if role in ROLES:
            others = sorted(e for e in edges if e.split(".")[0] in ROLES and e.split(".")[0] != role)
            assert not others, f"{name} imports another role package: {others}"
    assert not any(
        e.split(".")[0] in ROLES for n, es in import_graph(modules()).items() if n.startswith("asyncrl") for e in es
    ), "the core asyncrl imports a role package"


def test_the_cli_starts_each_role_through_one_entry_point():
    """`asyncrl buffer|generator|learner` import their role by name (asyncrl/launch/cli.py ROLE_MAINS), only
    when the command runs; each name is a function of that role's package."""
    from asyncrl.launch.cli import ROLE_MAINS

    assert sorted(ROLE_MAINS) == ["buffer", "generator", "learner"]
    for role, target in ROLE_MAINS.items():
        module, _, function = target.partition(":")
        assert module.split(".")[0] == role + "s", f"{role}: {target} is not in the {role}s package"
        tree = ast.parse(modules()[module].read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body), target
