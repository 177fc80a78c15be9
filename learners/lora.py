"""LoRA adapters on the policy (peft), and the merged full weights that generators and exports get.

Order under FSDP2: `get_peft_model` first, then `fully_shard` per decoder layer and on the root.
peft swaps each target `nn.Linear` in place for a `lora.Linear` holding the frozen `base_layer` and
the trainable `lora_A` / `lora_B`, so every FSDP unit owns its layer's base and adapter parameters
(FSDP2 allows frozen and trainable parameters in one unit; only the adapters get gradients, only they
are in the optimizer). The learner keeps the Hugging Face model peft modified (`get_base_model()`),
not the `PeftModel` wrapper, so its forward paths, layer lists and state-dict names stay those of the
plain model plus `.base_layer` / `.lora_{A,B}.default` parts.

Generators (vLLM) have no adapters: they receive W + scaling * B @ A for every adapted module under
the base model's own parameter names, exactly what peft's `merge_and_unload()` would give.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

log = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."
_BASE_PART = ".base_layer"


def apply_lora(model: nn.Module, lc) -> nn.Module:
    """Injects adapters per `learner.lora` (asyncrl.config.LoraConfig); returns the same Hugging Face
    model, modified in place, with only the adapter parameters left trainable."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError as e:  # a user mistake, not an invariant
        raise ValueError("learner.lora.enabled=true needs peft: pip install 'asyncrl[lora]' (or pip install peft)") from e

    peft_cfg = PeftLoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                              target_modules=list(lc.target_modules), bias="none")
    try:
        inner = get_peft_model(model, peft_cfg).get_base_model()
    except ValueError as e:  # peft: no module matched target_modules
        raise ValueError(f"learner.lora.target_modules={list(lc.target_modules)} does not fit "
                         f"{type(model).__name__}: {e}") from e
    # The merge below is W + s * B @ A, which is only what peft does for plain Linear layers.
    other = sorted({type(m).__name__ for m in inner.modules()
                    if isinstance(m, BaseTunerLayer) and not isinstance(m, LoraLinear)})
    if other:
        raise ValueError(f"learner.lora.target_modules must name Linear layers only; they matched {other}")
    trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
    total = sum(p.numel() for p in inner.parameters())
    log.info("LoRA rank=%d alpha=%g on %s: %d of %d parameters trainable (%.2f%%)", lc.rank, lc.alpha,
             ",".join(lc.target_modules), trainable, total, 100.0 * trainable / max(total, 1))
    return inner


def _is_lora_layer(module: nn.Module) -> bool:
    from peft.tuners.lora import Linear as LoraLinear

    return isinstance(module, LoraLinear)


def base_name(name: str) -> str:
    """The base model's parameter name for a peft one: `base_model.model.` and `.base_layer` go."""
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX):]
    return name.replace(_BASE_PART + ".", ".")


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model: every LoRA layer computes base_layer(x) only (the flag peft's
    `disable_adapter()` sets). Only the flag: peft's context also flips requires_grad of the adapter
    parameters, which would touch FSDP2's sharded parameters and the optimizer's for nothing (the
    reference pass runs under no_grad)."""
    layers = [m for m in model.modules() if _is_lora_layer(m)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m._disable_adapters = False


def merged_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """(base name, global shape) of every tensor `merged_tensors` yields, in the same order."""
    return [(base_name(k), tuple(t.shape)) for k, t in model.state_dict().items() if not _is_adapter_key(k)]


def _is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def merged_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(base name, full merged tensor) in state-dict order. A collective under FSDP2: every rank must
    iterate it to the end, in the same order (each `full_tensor()` is an all-gather)."""
    layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    sd = model.state_dict()
    for key, t in sd.items():
        if _is_adapter_key(key):
            continue  # folded into its base weight below
        full = _full(t)
        module_name, sep, leaf = key.rpartition(_BASE_PART + ".")
        if sep and leaf == "weight" and module_name in layers:
            m = layers[module_name]
            for adapter in m.active_adapters:
                a = _full(sd[f"{module_name}.lora_A.{adapter}.weight"])
                b = _full(sd[f"{module_name}.lora_B.{adapter}.weight"])
                delta = b @ a
                if m.fan_in_fan_out:
                    delta = delta.T
                # Same operations as peft's get_delta_weight + merge, so the result is bit-identical.
                full = full + delta * m.scaling[adapter]
        yield base_name(key), full
