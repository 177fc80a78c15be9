"""Checkpoints with torch.distributed.checkpoint (DCP), and Hugging Face export.

Layout under `checkpoint.dir` (default `{run_dir}/checkpoints`):
  step-000012/            DCP shards of {"model", "optim"} (+ {"critic", "critic_optim"} with a critic)
                          from every rank; with LoRA "model" holds the adapters only (the frozen
                          base is model.path, loaded again on resume)
  step-000012/meta.json   version, step, scheduler/controller state, dataset cursor (rank 0)
  step-000012/rng-rank{r}.bin
  step-000012/COMPLETE    written last: a checkpoint without it is ignored (a crash mid-save)

The learner acks the trajectories of a step only after the checkpoint holding that step's update
has its COMPLETE marker, so after a crash every trajectory has shaped the persisted model once.
meta.json lists those entries (`acked_entries`): a learner that died between the marker and the ack
acks them on resume instead of training them again (learners/feed.py `ack_checkpointed`).
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

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


def _state(model, optimizer, critic, adapters_only: bool) -> dict:
    """The DCP state dict: the policy (only its trainable parameters when `adapters_only`), its
    optimizer, and the critic + its optimizer when `critic` is a (model, optimizer) pair."""
    model_sd, optim_sd = get_state_dict(model, optimizer,
                                        options=StateDictOptions(ignore_frozen_params=adapters_only))
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(*critic)
    return state


def save(root: Path, step: int, model, optimizer, meta: dict, keep: int, critic=None,
         adapters_only: bool = False) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory once it is durable."""
    path = step_dir(root, step)
    rank = dist.get_rank()
    state = _state(model, optimizer, critic, adapters_only)
    meta = {**meta, "parts": sorted(state), "adapters_only": adapters_only}
    dcp.save(state, checkpoint_id=str(path))
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


def load(path: Path, model, optimizer, critic=None, adapters_only: bool = False) -> dict:
    """Collective: restores model, optimizer (and critic), this rank's RNG; returns meta.json."""
    meta = json.loads((path / "meta.json").read_text())
    state = _state(model, optimizer, critic, adapters_only)
    # Checkpoints from before critics and LoRA hold model + optim, whole.
    saved = (sorted(meta.get("parts", ["model", "optim"])), bool(meta.get("adapters_only", False)))
    if saved != (sorted(state), adapters_only):
        raise ValueError(f"checkpoint {path} holds {saved[0]} (adapters only: {saved[1]}), this learner needs "
                         f"{sorted(state)} (adapters only: {adapters_only}): resume with the config it was saved "
                         "with (learner.lora.enabled, algorithm.advantage), or set checkpoint.resume=never")
    dcp.load(state, checkpoint_id=str(path))
    # Without the frozen base in the checkpoint the model's load is not strict; DCP itself has already
    # failed on any adapter (trainable) key the checkpoint lacks.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=adapters_only, strict=not adapters_only))
    if critic is not None:
        set_state_dict(*critic, model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])
    rng_file = path / f"rng-rank{dist.get_rank()}.bin"
    if rng_file.exists():
        torch.set_rng_state(torch.from_numpy(np.frombuffer(rng_file.read_bytes(), dtype=np.uint8).copy()))
    return meta


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
