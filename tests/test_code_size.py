"""Size rule of the package code (asyncrl/, buffers/, generators/, learners/): no function over
MAX_FUNCTION_LINES lines and no class over MAX_CLASS_LINES, measured from the `def` / `class` line to
the last line of the body (decorators left out; a nested function counts within its parent too)."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("asyncrl", "buffers", "generators", "learners")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
# Classes over the limit for now, by "path:Name"; each entry goes once its class is within the limit.
ALLOWED_LARGE_CLASSES: set[str] = set()


def oversized(path: Path, root: Path = REPO) -> list[str]:
    """"path:name (N lines)", path relative to `root`, for every function and class of the file over its limit."""
    rel = path.relative_to(root).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            limit = MAX_FUNCTION_LINES
        elif isinstance(node, ast.ClassDef):
            limit = MAX_CLASS_LINES
        else:
            continue
        lines = node.end_lineno - node.lineno + 1
        if lines > limit:
            found.append(f"{rel}:{node.name} ({lines} lines)")
    return found


def test_no_function_or_class_over_the_size_limits():
    found = [item for pkg in PACKAGES for path in sorted((REPO / pkg).rglob("*.py")) for item in oversized(path)]
    over = [item for item in found if item.split(" (")[0] not in ALLOWED_LARGE_CLASSES]
    assert not over, (f"over {MAX_FUNCTION_LINES} lines a function / {MAX_CLASS_LINES} a class; split into "
                      f"named parts: {over}")


def test_measure_counts_from_def_to_last_line(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))  # def + 60 lines = 61
    (tmp_path / "m.py").write_text(f"@staticmethod\ndef f():\n{body}\n\n\ndef g():\n    pass\n")
    assert oversized(tmp_path / "m.py", tmp_path) == [f"m.py:f ({MAX_FUNCTION_LINES + 1} lines)"]
