"""Every private torch API asyncrl uses, in one place, each with a public way to do without it.

torch's private names move between releases without notice. Each use here is checked against the
installed torch (`problems()` lists what is missing; a test runs it on the installed torch), and each call
falls back to public API when its private name is gone, losing only what the private API added:
- gloo process-group options (`ProcessGroupGloo._Options`: worker threads, the interface to bind):
  without them the group is built with a timeout only (gloo's default threads and device);
- a storage's use count (`torch._C._storage_Use_Count`): without it, no host buffer is ever reused;
- the fused multi-tensor norm and scale (`torch._foreach_norm`, `torch._foreach_mul_`): without
  them, one kernel per tensor.
Read against torch 2.11 (CUDA) and 2.13 (CPU); `TESTED` names the versions.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TESTED = ("2.11", "2.13")  # torch releases whose private names these were checked against

_CHECKS = {
    "torch.distributed.ProcessGroupGloo._Options": lambda: dist.ProcessGroupGloo._Options,
    "ProcessGroupGloo._Options()._timeout/_threads/_devices":
        lambda: all(hasattr(dist.ProcessGroupGloo._Options(), a) for a in ("_timeout", "_threads", "_devices")) or None,
    "torch.distributed.ProcessGroupNCCL.Options()._timeout":
        lambda: (not dist.is_nccl_available()) or hasattr(dist.ProcessGroupNCCL.Options(), "_timeout") or None,
    "torch._C._storage_Use_Count": lambda: torch._C._storage_Use_Count,
    "torch._foreach_norm": lambda: torch._foreach_norm,
    "torch._foreach_mul_": lambda: torch._foreach_mul_,
}
_warned: set[str] = set()


def problems() -> list[str]:
    """The private names above that the installed torch lacks (empty when all are there)."""
    missing = []
    for name, get in _CHECKS.items():
        try:
            if get() is None:
                missing.append(name)
        except (AttributeError, TypeError, RuntimeError):
            missing.append(name)
    return missing


def version_note() -> str | None:
    """A line when the installed torch is not one of TESTED (the fallbacks still apply), else None."""
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if release in TESTED:
        return None
    return f"torch {torch.__version__}: private APIs checked on torch {', '.join(TESTED)} only (asyncrl/protocol/torch_private.py)"


def _warn_once(what: str, lost: str) -> None:
    if what not in _warned:
        _warned.add(what)
        log.warning("torch %s has no %s: %s", torch.__version__, what, lost)


def gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta, threads: int,
               interface: str = "", hostname: str = "127.0.0.1"):
    """A gloo process group with `threads` worker threads on one device: the network interface
    `interface` when given, else the one `hostname` resolves to."""
    opts_cls = getattr(dist.ProcessGroupGloo, "_Options", None)
    if opts_cls is not None:
        opts = opts_cls()
        if all(hasattr(opts, a) for a in ("_timeout", "_threads", "_devices")):
            opts._timeout = timeout
            opts._threads = threads
            device = (dist.ProcessGroupGloo.create_device(interface=interface) if interface
                      else dist.ProcessGroupGloo.create_device(hostname=hostname))
            opts._devices = [device]
            return dist.ProcessGroupGloo(store, rank, size, opts)
    _warn_once("ProcessGroupGloo._Options", "the weight group uses gloo's default threads and device "
               "(set GLOO_SOCKET_IFNAME to choose the interface)")
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def nccl_group(store: dist.Store, rank: int, size: int, timeout: timedelta):
    """An NCCL process group with `timeout` (torch's default timeout without the private field)."""
    opts = dist.ProcessGroupNCCL.Options()
    if hasattr(opts, "_timeout"):
        opts._timeout = timeout
    else:
        _warn_once("ProcessGroupNCCL.Options._timeout", "the weight group uses NCCL's default timeout")
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def storage_use_count(t: torch.Tensor) -> int | None:
    """References to `t`'s storage (views and in-flight work hold one each), or None when torch has
    no way to say. torch has no public count; inductor's CUDA-graph trees use this one."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        _warn_once("_storage_Use_Count", "host buffers for weight pushes are not reused")
        return None
    return use_count(t.untyped_storage()._cdata)


def foreach_norm(tensors: list[torch.Tensor], p: float = 2.0) -> list[torch.Tensor]:
    """The p-norm of each tensor (one fused kernel where torch has it)."""
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, p))
    return [torch.linalg.vector_norm(t, p) for t in tensors]


def foreach_mul_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Scales every tensor in place by `scale` (one fused kernel where torch has it)."""
    fused = getattr(torch, "_foreach_mul_", None)
    if fused is not None:
        fused(tensors, scale)
        return
    for t in tensors:
        t.mul_(scale)
