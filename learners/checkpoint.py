"""Checkpoints with torch.distributed.checkpoint (DCP), and Hugging Face export.

Layout under `checkpoint.dir` (default `{run_dir}/checkpoints`):
  step-000012/            DCP shards of {"model", "optim"} from every rank
  step-000012/meta.json   version, step, scheduler/controller state, dataset cursor (rank 0)
  step-000012/rng-rank{r}.bin
  step-000012/COMPLETE    written last: a checkpoint without it is ignored (a crash mid-save)

The learner acks the trajectories of a step only after the checkpoint holding that step's update
has its COMPLETE marker, so after a crash every trajectory has shaped the persisted model once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger(__name__)

MARKER = "COMPLETE"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def latest(root: Path) -> Path | None:
    """The newest checkpoint whose save completed, or None."""
    if not root.exists():
        return None
    done = sorted(p for p in root.glob("step-*") if (p / MARKER).exists())
    return done[-1] if done else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: Path, step: int, model, optimizer, meta: dict, keep: int) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory once it is durable."""
    path = step_dir(root, step)
    rank = dist.get_rank()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    rng = torch.get_rng_state().numpy()
    (path / f"rng-rank{rank}.bin").write_bytes(rng.tobytes())
    dist.barrier()
    if rank == 0:
        (path / "meta.json").write_text(json.dumps(meta, indent=2))
        for f in path.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        (path / MARKER).write_text("ok\n")
        _fsync_dir(path)
        _fsync_dir(root)
        for old in sorted(p for p in root.glob("step-*") if (p / MARKER).exists())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def load(path: Path, model, optimizer) -> dict:
    """Collective: restores model, optimizer and this rank's RNG; returns meta.json."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng_file = path / f"rng-rank{dist.get_rank()}.bin"
    if rng_file.exists():
        torch.set_rng_state(torch.from_numpy(np.frombuffer(rng_file.read_bytes(), dtype=np.uint8).copy()))
    return json.loads((path / "meta.json").read_text())


def export_hf(out: Path, model_path: str, named_full_tensors, rank: int, dtype: torch.dtype) -> Path | None:
    """Collective over the gathers; rank 0 writes `model.safetensors` + config + tokenizer files."""
    from safetensors.torch import save_file

    tensors = {}
    for name, t in named_full_tensors:
        if rank == 0:
            tensors[name] = t.detach().to("cpu", dtype).contiguous()
    if rank != 0:
        return None
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    src = Path(model_path)
    if src.is_dir():
        for f in src.iterdir():
            if f.suffix in (".json", ".txt", ".model") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    else:
        from transformers import AutoConfig, AutoTokenizer

        AutoConfig.from_pretrained(model_path).save_pretrained(out)
        AutoTokenizer.from_pretrained(model_path).save_pretrained(out)
    log.info("exported Hugging Face model to %s", out)
    return out
