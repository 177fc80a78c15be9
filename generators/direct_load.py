"""Loading a pushed version straight into a vLLM model's parameters: one copy per tensor.

vLLM's in-place reload (`model_runner.reload_weights(..., is_checkpoint_format=True)`) is generic:
it puts every layer back on the meta device, re-materialises it, runs each parameter's weight loader
and the layer's post-load processing, then copies the result into the old storage. For a dense,
unquantized model without tensor parallelism most of that is not needed: the checkpoint layout is the
kernel layout, and a pushed tensor has one destination, a slice of one parameter. `DirectLoader`
works those slices out once per layout and then loads a version with one `copy_` per tensor:
- a tensor of a stacked (fused) parameter (`q_proj`, `k_proj`, `v_proj` into `qkv_proj`; `gate_proj`,
  `up_proj` into `gate_up_proj`: the model's `packed_modules_mapping`) goes to its rows of it, in the
  order the mapping lists the parts;
- a vocabulary padded by vLLM takes the pushed rows and leaves the padding alone;
- a tied output head is the embedding: the caller re-ties it after the load;
- a layer whose kernel reads a processed copy of its weight (vLLM's CPU build packs every linear
  layer's weight for oneDNN and drops the original) keeps a checkpoint-layout tensor of ours: the
  load copies into it, gives it back to the layer and re-runs the layer's post-load processing. On
  CUDA an unquantized layer has no post-load processing, so nothing runs after the copies.
Parameters keep their storage (captured CUDA graphs hold their addresses).

Anything this does not know (quantization, tensor or pipeline parallelism, a name with no
parameter, a parameter no pushed tensor covers, a shape that does not add up) raises `Unsupported`
when the plan is built, and the caller keeps the generic reload.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.protocol.schema import TensorMeta
from asyncrl.protocol.weight_sync import to_dtype

# Methods whose post-load processing we know: none on CUDA; on the CPU build a packed copy for the
# GEMM kernel, made again from the parameter after each load.
KNOWN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
SKIPPED_PARTS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class Unsupported(Exception):
    """The model's layout needs vLLM's generic reload; the message says why."""


@dataclass
class _Param:
    """One vLLM parameter and the checkpoint-layout tensor the pushed parts are copied into."""

    module: torch.nn.Module
    leaf: str
    full: torch.Tensor
    own: bool  # `full` is ours (the layer keeps a processed copy): handed back before processing
    parts: list[tuple[int, str, tuple[int, ...]]] = field(default_factory=list)  # (index, name, shape)


class DirectLoader:
    """The copy plan of one model for one push layout (`metas`: the announcement's tensors)."""

    def __init__(self, model: torch.nn.Module, metas: list[TensorMeta], *, tied: bool, post_process: bool,
                 dtype: torch.dtype | None = None):
        """`dtype`: the engine's (of the tensors we keep for processed layers); the wire's when None."""
        self.model, self.dtype = model, dtype
        self.views: dict[str, torch.Tensor] = {}
        self.skipped: set[str] = set()
        self.processed: list[torch.nn.Module] = []  # post-load processing after each load (CPU build)
        self.owned: list[_Param] = []
        self.owned_names: set[str] = set()  # tensors whose place is a copy of ours (not readable in the model)
        packed = getattr(type(model), "packed_modules_mapping", None) or {}
        part_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        params: dict[tuple[str, str], _Param] = {}
        shapes = {m.name: (tuple(m.shape), to_dtype(m.dtype)) for m in metas}
        for name, (shape, _) in shapes.items():
            if name.endswith(SKIPPED_PARTS) or (tied and name.startswith("lm_head.")):
                self.skipped.add(name)
                continue
            path, _, leaf = name.rpartition(".")
            parent, _, last = path.rpartition(".")
            index = 0
            if last in part_of:
                fused, index = part_of[last]
                path = f"{parent}.{fused}" if parent else fused
            key = (path, leaf)
            if key not in params:
                try:
                    module = model.get_submodule(path)
                except AttributeError as e:
                    raise Unsupported(f"{name}: vLLM's model has no module {path}") from e
                params[key] = _Param(module, leaf, torch.empty(0), own=False)
            params[key].parts.append((index, name, shape))
        for (path, _), p in params.items():
            self._plan(path, p, shapes, packed.get(path.rpartition(".")[2]), post_process)
        self.params = list(params.values())
        self._check_coverage(params, tied)

    def _plan(self, path: str, p: _Param, shapes, fused_parts, post_process: bool) -> None:
        method = getattr(p.module, "quant_method", None)
        if method is not None and type(method).__name__ not in KNOWN_METHODS:
            raise Unsupported(f"{path}: quantization method {type(method).__name__}")
        p.parts.sort()
        if fused_parts is not None and [i for i, _, _ in p.parts] != list(range(len(fused_parts))):
            raise Unsupported(f"{path}.{p.leaf}: the push has parts {[n for _, n, _ in p.parts]} of {fused_parts}")
        trailing = {shape[1:] for _, _, shape in p.parts}
        if len(trailing) != 1:
            raise Unsupported(f"{path}.{p.leaf}: parts of different widths {sorted(trailing)}")
        rows = sum(shape[0] for _, _, shape in p.parts) if p.parts[0][2] else 0
        full_shape = (rows, *trailing.pop()) if p.parts[0][2] else ()
        live = getattr(p.module, p.leaf, None)
        dtype = self.dtype or shapes[p.parts[0][1]][1]
        if isinstance(live, torch.Tensor) and tuple(live.shape) == full_shape:
            p.full = live.data
        elif (isinstance(live, torch.Tensor) and fused_parts is None and full_shape
              and getattr(p.module, "org_vocab_size", None) == rows and live.dim() == len(full_shape)
              and live.shape[0] > rows and tuple(live.shape[1:]) == full_shape[1:]):
            p.full = live.data  # a vocabulary vLLM padded (an embedding or head): the pushed rows come first
        elif post_process and method is not None and (live is None or live.numel() == 0):
            p.full, p.own = torch.empty(full_shape, dtype=dtype, device=_device_of(p.module)), True
            self.owned.append(p)
            self.owned_names.update(name for _, name, _ in p.parts)
        else:
            got = tuple(live.shape) if isinstance(live, torch.Tensor) else None
            raise Unsupported(f"{path}.{p.leaf}: vLLM holds shape {got}, the push {full_shape}")
        offset = 0
        for _, name, shape in p.parts:
            n = shape[0] if shape else 1
            self.views[name] = p.full.narrow(0, offset, n) if shape else p.full
            offset += n
        if post_process and method is not None and p.module not in self.processed:
            self.processed.append(p.module)

    def _check_coverage(self, params: dict[tuple[str, str], _Param], tied: bool) -> None:
        """Every parameter of the model gets its values from the push (a tied head from the embedding)."""
        covered = {(id(p.module), p.leaf) for p in params.values()}
        for name, module in self.model.named_modules():
            for leaf, _ in module.named_parameters(recurse=False):
                if (id(module), leaf) in covered or (tied and name.startswith("lm_head")):
                    continue
                raise Unsupported(f"{name}.{leaf}: no pushed tensor covers this parameter")

    @torch.no_grad()
    def load(self, weights) -> int:
        """Copies every pushed tensor to its place; returns how many. Raises on a name outside the plan
        or a missing one: the announcement the plan was built from names every tensor."""
        n = 0
        for name, tensor in weights:
            dst = self.views.get(name)
            if dst is None:
                if name in self.skipped:
                    continue
                raise KeyError(f"direct load: {name} is not in the plan")
            dst.copy_(tensor.view(dst.shape), non_blocking=True)
            n += 1
        if n != len(self.views):
            raise RuntimeError(f"direct load: {n} of {len(self.views)} tensors arrived")
        for p in self.owned:
            setattr(p.module, p.leaf, torch.nn.Parameter(p.full, requires_grad=False))
        for module in self.processed:
            module.quant_method.process_weights_after_loading(module)
        return n

    @torch.no_grad()
    def mismatches(self, weights) -> list[str]:
        """After a load by another path: the pushed tensors whose place in the model (those vLLM keeps
        in the checkpoint layout) does not hold exactly their values. Empty: the plan is right."""
        bad = []
        for p in self.params:  # a parameter whose storage was replaced: the views point at the old one
            live = getattr(p.module, p.leaf, None)
            if not p.own and (not isinstance(live, torch.Tensor)
                              or live.untyped_storage().data_ptr() != p.full.untyped_storage().data_ptr()):
                bad.extend(f"{name} (storage replaced)" for _, name, _ in p.parts)
        for name, tensor in weights:
            dst = self.views.get(name)
            if dst is None or name in self.owned_names:
                continue
            if not torch.equal(dst, tensor.to(device=dst.device, dtype=dst.dtype).view(dst.shape)):
                bad.append(name)
        return bad


def _device_of(module: torch.nn.Module) -> torch.device:
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        return t.device
    return torch.device("cpu")
