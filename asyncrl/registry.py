"""One registry per algorithm family: a decorator names a function, and that name is what the config
accepts, what the learner looks up and what docs/algorithms.md lists.

    @ADVANTAGES.register("grpo", ref="DeepSeekMath (arXiv:2402.03300)", group=True)
    def _grpo(x: AdvantageInputs): ...

Adding an algorithm touches one file: the function and its decorator in the family's module. The
config (asyncrl/config.py) must not import torch, so it reads the names without importing the
family's module: `Registry.names()` scans the module's source for `NAME.register("...")` decorators
(string literals only), and a test checks that the scan and the imported registry agree.

This module imports only the standard library.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Entry:
    name: str
    fn: Callable
    summary: str  # the first line of the function's docstring: what it is for
    ref: str  # the paper or reference implementation
    meta: dict[str, Any] = field(default_factory=dict)  # family-specific flags (e.g. group=True)


class Registry:
    """Names -> functions of one family (`var` is this object's name below, which the source scan
    looks for; `module` is the file that registers them)."""

    def __init__(self, var: str, key: str, module: str, title: str):
        self.var, self.key, self.module, self.title = var, key, module, title
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, ref: str, **meta) -> Callable[[Callable], Callable]:
        def deco(fn: Callable) -> Callable:
            assert name not in self._entries, f"{self.key}: {name!r} registered twice"
            doc = (fn.__doc__ or "").strip().splitlines()
            assert doc, f"{self.key}={name}: the registered function needs a docstring (its first line is the docs)"
            self._entries[name] = Entry(name, fn, doc[0].strip(), ref, dict(meta))
            return fn

        return deco

    def entries(self) -> dict[str, Entry]:
        """Every entry, in registration order (imports the family's module, hence torch)."""
        importlib.import_module(self.module)
        return self._entries

    def get(self, name: str) -> Entry:
        entries = self.entries()
        if name not in entries:
            raise ValueError(f"{self.key}: {name!r} is not one of {list(entries)}")
        return entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, read from the module's source without importing it."""
        return tuple(self._scan())

    def static_meta(self, name: str) -> dict[str, Any]:
        """The decorator's literal keyword arguments for `name` (without importing the module)."""
        return self._scan()[name]

    @functools.cache  # noqa: B019 - one Registry per family, alive for the whole process
    def _scan(self) -> dict[str, dict[str, Any]]:
        path = _HERE.parent / (self.module.replace(".", "/") + ".py")
        found: dict[str, dict[str, Any]] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef):
                continue
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute) and dec.func.attr == "register"
                        and isinstance(dec.func.value, ast.Name) and dec.func.value.id == self.var):
                    name = ast.literal_eval(dec.args[0])
                    found[name] = {k.arg: ast.literal_eval(k.value) for k in dec.keywords if k.arg and k.arg != "ref"}
        return found


# How a policy loss corrects for the lag between the behaviour policy mu (the generator's weights, up
# to algorithm.max_staleness versions old) and pi_prox: every entry of POLICY_LOSSES declares one as
# `correction=`; a loss without one is refused with algorithm.max_staleness > 0.
CORRECTIONS = {
    "behaviour_weight": "x min(pi_prox/mu, is_cap) at pi_prox (is_level=sequence: of the whole sequence's product)",
    "seq_geo_weight": "x min(geometric mean over the sequence of pi_prox/mu, is_cap): the form of its sequence ratio",
    "masked_weight": "x pi_prox/mu at pi_prox, 0 outside [mis.low, mis.high]",
    "ratio_vs_behaviour": "its own ratio is taken against mu",
    "quadratic_leash": "its penalty (log pi - log mu)^2 is taken against mu",
}
# The corrections that are a behaviour IS weight (what algorithm.is_normalize and otb_is_weights take).
IS_WEIGHT_CORRECTIONS = ("behaviour_weight", "seq_geo_weight", "masked_weight")

ADVANTAGES = Registry("ADVANTAGES", "algorithm.advantage", "asyncrl.algorithms.advantages", "Advantage estimators")
POLICY_LOSSES = Registry("POLICY_LOSSES", "algorithm.loss", "asyncrl.algorithms.losses", "Policy losses")
KL_ESTIMATORS = Registry("KL_ESTIMATORS", "algorithm.kl_estimator", "asyncrl.algorithms.kl", "KL estimators")
AGGREGATIONS = Registry("AGGREGATIONS", "algorithm.aggregation", "asyncrl.algorithms.aggregation", "Loss aggregations")
ROLLOUT_CORRECTIONS = Registry("ROLLOUT_CORRECTIONS", "algorithm.rollout_rs", "asyncrl.algorithms.rollout_correction",
                               "Rollout corrections (rejection sampling)")
FAMILIES = (ADVANTAGES, POLICY_LOSSES, KL_ESTIMATORS, AGGREGATIONS, ROLLOUT_CORRECTIONS)

DOCS_BEGIN = "<!-- registry tables: generated by `python -m asyncrl.registry --write docs/algorithms.md` -->"
DOCS_END = "<!-- end of registry tables -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe inside a table cell ends the cell


def docs_tables() -> str:
    """The markdown tables of every family, as docs/algorithms.md holds them."""
    out = [DOCS_BEGIN, ""]
    for reg in FAMILIES:
        out += [f"### {reg.title} (`{reg.key}`)", ""]
        if reg is POLICY_LOSSES:
            out += ["| value | what it is for | off-policy correction | reference |", "|---|---|---|---|"]
            out += [f"| `{e.name}` | {_cell(e.summary)} | {_cell(CORRECTIONS[e.meta['correction']])} | {_cell(e.ref)} |"
                    for e in reg.entries().values()]
        else:
            out += ["| value | what it is for | reference |", "|---|---|---|"]
            out += [f"| `{e.name}` | {_cell(e.summary)} | {_cell(e.ref)} |" for e in reg.entries().values()]
        out.append("")
    out.append(DOCS_END)
    return "\n".join(out)


def rewrite_docs(path: Path) -> bool:
    """Replaces the generated section of `path`; True when it changed."""
    text = path.read_text()
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END)
    new = text[:start] + docs_tables() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    import argparse

    # As `python -m`, this file is __main__: the families register into the imported asyncrl.registry.
    from asyncrl.registry import docs_tables, rewrite_docs

    p = argparse.ArgumentParser(description="print (or write into a docs page) the algorithm registry tables")
    p.add_argument("--write", type=Path, help="a markdown file holding the generated section")
    args = p.parse_args()
    if args.write:
        print(f"{args.write}: {'updated' if rewrite_docs(args.write) else 'up to date'}")
    else:
        print(docs_tables())
