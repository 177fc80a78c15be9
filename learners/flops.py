"""The learner step's model FLOPs and the device's peak: the one count that the learner's `mfu` /
`tflops` metrics and benchmarks/learner_throughput.py both use.

Per real token (prompt + completion, no padding) of a decoder with N_body matmul parameters (every
Linear weight but the output head's; embedding lookups are not matmuls), a pass costs f x N_body,
f = 2 for a forward without grad and 6 for a forward + backward; causal attention costs f x layers x
n^2 x d_attn for a sequence of n tokens (d_attn = heads x head_dim; each query sees n/2 keys on
average, QK^T and AV 2 FLOPs per multiply-add each); the output head (V x H) runs on the completion
tokens only (all the loss needs), f x V x H each. A step adds up its passes: the reference's and the
proximal forward (no grad, when they run), one forward + backward per epoch, and a critic's forward
and its training (its scalar value head not counted). Recomputation (the chunked head's backward in
recompute mode, activation checkpointing) is work done but not counted: MFU counts the model's
FLOPs, as torchtitan and the PaLM paper do.

The peak is a bf16 8192^3 matmul measured on the device (fp32 512^3 on a CPU, labelled as such),
cached per device name in ~/.cache/asyncrl/peak_flops.json ($XDG_CACHE_HOME honoured), or
`learner.peak_tflops` when set.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

TRAIN, FORWARD = 6, 2  # FLOPs per parameter and token: forward + backward, forward without grad


@dataclass(frozen=True)
class ModelFlops:
    """What a model's FLOPs per token depend on."""

    body_params: int  # Linear weights of the decoder (the output head left out)
    head_params: int  # V x H of the output head (0 for a critic's scalar head)
    num_layers: int
    attn_dim: int  # heads x head_dim

    @classmethod
    def of(cls, model: nn.Module, with_head: bool = True) -> ModelFlops:
        """From a Hugging Face causal LM (plain, FSDP2-sharded or with LoRA adapters): every Linear
        weight counted once, by its full (unsharded) size."""
        head = model.get_output_embeddings() if with_head and hasattr(model, "get_output_embeddings") else None
        head_w = head.weight if isinstance(head, nn.Linear) else None
        seen, body = set(), 0
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and id(mod.weight) not in seen and mod.weight is not head_w:
                seen.add(id(mod.weight))
                body += mod.weight.numel()
        # A critic (learners/critic.py) wraps the decoder: its config is the backbone's.
        c = model.config if hasattr(model, "config") else model.backbone.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(body, head_w.numel() if head_w is not None else 0, c.num_hidden_layers,
                   c.num_attention_heads * head_dim)

    def pass_flops(self, factor: int, lengths: list[int], head_tokens: int) -> float:
        """One pass (factor TRAIN or FORWARD) over sequences of `lengths` real tokens, the output head
        on `head_tokens` of them."""
        attn = self.num_layers * self.attn_dim * sum(n * n for n in lengths)
        return factor * (self.body_params * sum(lengths) + attn + self.head_params * head_tokens)


def step_flops(policy: ModelFlops, lengths: list[int], completion_tokens: int, *, epochs: int = 1,
               reference: bool = False, proximal: bool = False, critic: ModelFlops | None = None) -> float:
    """The model FLOPs of one learner step over all ranks: `epochs` forward + backward passes of the
    policy, a no-grad pass each for the reference and the proximal policy when they run, and with a
    critic one no-grad pass (the old values) and `epochs` trained ones."""
    no_grad = int(reference) + int(proximal)
    total = (epochs * policy.pass_flops(TRAIN, lengths, completion_tokens)
             + no_grad * policy.pass_flops(FORWARD, lengths, completion_tokens))
    if critic is not None:
        total += (epochs * critic.pass_flops(TRAIN, lengths, 0) + critic.pass_flops(FORWARD, lengths, 0))
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_peak_flops(device: torch.device, size: int | None = None, reps: int = 10) -> float:
    """FLOP/s of a size^3 matmul on `device`: bf16 8192^3 on a GPU, fp32 512^3 on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = size or (8192 if device.type == "cuda" else 512)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * size**3 * reps / (time.perf_counter() - t0)


def device_label(device: torch.device) -> str:
    """The cache key and the label of a peak: the device's name and the matmul's dtype."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} bf16"
    return f"cpu fp32 ({os.cpu_count()} cpus)"


def cache_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asyncrl" / "peak_flops.json"


def device_peak_flops(device: torch.device, configured_tflops: float = 0.0) -> tuple[float, str]:
    """(peak FLOP/s, where it came from): `configured_tflops` when > 0, else the cached measurement
    for this device name, else one measured now and cached (written atomically: several ranks may
    measure at once)."""
    if configured_tflops > 0:
        return configured_tflops * 1e12, "learner.peak_tflops"
    label, path = device_label(device), cache_path()
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        cached = {}
    if isinstance(cached.get(label), (int, float)) and cached[label] > 0:
        return float(cached[label]), f"measured {label} (cached in {path})"
    peak = measure_peak_flops(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**cached, label: peak}, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: measured again next time
    return peak, f"measured {label}"
