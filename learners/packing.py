"""Which sequences a learner rank runs together: mini-batches, micro-batches and the attention that
keeps packed sequences apart.

A step's groups are split into `learner.minibatches` disjoint mini-batches of whole groups (one
optimizer step each), reshuffled every epoch. Each mini-batch's sequences go to world x m bins of at
most `learner.micro_batch_tokens` tokens by longest-first-into-the-emptiest-bin, m the same on every
rank (ranks take part in the same FSDP collectives, so they run the same number of micro-batches);
rank r runs m of them and accumulates their gradients. Every rank computes the same plan from the
step's sequence lengths alone: no communication.

Packed micro-batches put their sequences in one row with per-sequence position ids; attention never
crosses a sequence boundary: FlashAttention varlen (`torch.nn.attention.varlen`) on CUDA in 16-bit,
else SDPA with the block-diagonal causal mask that transformers derives from the position ids.
"""

from __future__ import annotations

import functools
import heapq
import inspect
import logging
import math
import random
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

VARLEN_ATTENTION = "asyncrl_varlen"


@dataclass
class MiniBatch:
    """One optimizer step: `micro[r]` lists rank r's micro-batches (each a list of sequence indices
    into the step; an empty one still runs, with no loss, to keep the collectives in step);
    `num_tokens` / `num_seqs` are the mini-batch's completion tokens and sequences on all ranks,
    the loss normalisers."""

    micro: list[list[list[int]]]
    num_tokens: int
    num_seqs: int


@dataclass
class StepPlan:
    epochs: list[list[MiniBatch]] = field(default_factory=list)

    @property
    def num_updates(self) -> int:
        return sum(len(e) for e in self.epochs)

    def micro_batches(self, rank: int) -> int:
        """Training micro-batches this rank runs in the step (every epoch, every mini-batch)."""
        return sum(len(mb.micro[rank]) for e in self.epochs for mb in e)

    def processed_tokens(self, lengths: list[int], packed: bool) -> int:
        """Token positions every rank's training micro-batches run through the model, padding
        included (rows x longest when padded; one two-token row for an empty micro-batch)."""
        return sum(_bin_cost(lengths, b, packed) if b else 2
                   for e in self.epochs for mb in e for rank in mb.micro for b in rank)


def balanced_bins(lengths: list[int], items: list[int], k: int) -> list[list[int]]:
    """`items` (indices into `lengths`) in `k` bins of near-equal total length: longest first, each
    into the bin with the least so far (ties: fewest items, then lowest index)."""
    heap = [(0, 0, b) for b in range(k)]
    bins: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        total, count, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (total + lengths[i], count + 1, b))
    return bins


def _bin_cost(lengths: list[int], bin_: list[int], packed: bool) -> int:
    if not bin_:
        return 0
    return sum(lengths[i] for i in bin_) if packed else len(bin_) * max(lengths[i] for i in bin_)


def micro_bins(lengths: list[int], items: list[int], world: int, budget: int, packed: bool) -> list[list[list[int]]]:
    """Rank r's micro-batches (`result[r]`, the same count on every rank) for one mini-batch: the
    fewest bins per rank such that every bin fits `budget` tokens (padded: rows x longest), a bin of
    one sequence longer than the budget excepted. Bins go to ranks largest first, round robin."""
    total = sum(lengths[i] for i in items)
    m = max(1, math.ceil(total / (world * budget)))
    while True:
        bins = balanced_bins(lengths, items, world * m)
        if all(_bin_cost(lengths, b, packed) <= budget or len(b) <= 1 for b in bins):
            break
        m += 1
    bins.sort(key=lambda b: -_bin_cost(lengths, b, packed))
    return [bins[r::world] for r in range(world)]


def plan_step(group_sizes: list[int], lengths: list[int], comp_lengths: list[int], *, world: int, minibatches: int,
              epochs: int, budget: int, packed: bool, seed: int) -> StepPlan:
    """The step's updates: `epochs` passes, each over `minibatches` disjoint mini-batches of whole
    groups (groups shuffled by `seed` and the epoch). `lengths`: tokens of each sequence (prompt +
    completion), in group order; `comp_lengths`: its completion tokens."""
    if minibatches > len(group_sizes):
        raise ValueError(f"learner.minibatches={minibatches} but the step has only {len(group_sizes)} groups")
    starts = [0]
    for n in group_sizes:
        starts.append(starts[-1] + n)
    plan = StepPlan()
    for epoch in range(epochs):
        order = list(range(len(group_sizes)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        epoch_plan = []
        for k in range(minibatches):
            groups = order[k::minibatches]
            seqs = [s for g in sorted(groups) for s in range(starts[g], starts[g + 1])]
            epoch_plan.append(MiniBatch(micro=micro_bins(lengths, seqs, world, budget, packed),
                                        num_tokens=sum(comp_lengths[s] for s in seqs), num_seqs=len(seqs)))
        plan.epochs.append(epoch_plan)
    return plan


MIN_AUTO_TOKENS = 4096  # below this, micro-batches are too small to keep a GPU busy: checkpoint instead
MAX_AUTO_TOKENS = 65536
_HEADROOM = 0.8  # of what is left: the caching allocator's fragmentation, the kernels' workspaces
_SLACK = 1 << 30  # bytes kept free besides (the CUDA context, NCCL buffers, compiled graphs)


@dataclass(frozen=True)
class MemoryNeeds:
    """What a rank will still allocate besides the activations, in bytes, measured when the models
    are loaded and their optimizers made (learners/setup.py `memory_needs`)."""

    pending: int = 0  # training state not allocated yet: gradients, optimizer moments, gathered compute copies
    reserve: int = 0  # fixed workspaces: the output head's chunks, kept logits, a generator sharing the GPU


def activation_bytes_per_token(model_config, dtype: torch.dtype, checkpointing: bool) -> int:
    """Bytes one token's activations hold through forward and backward: about (16 H + 4 I) values per
    decoder layer in the compute dtype (H hidden, I MLP width; 3.4 MB a token at Qwen2.5-1.5B, where
    an H100 measured 3.2 MB a token between 4096- and 12288-token micro-batches), one layer's worth
    plus the 2 H layer inputs kept per layer with activation checkpointing; plus the head's saved
    hidden row and its statistics."""
    h = model_config.hidden_size
    inter = getattr(model_config, "intermediate_size", 4 * h)
    layers = model_config.num_hidden_layers
    per_layer = (16 * h + 4 * inter) * dtype.itemsize
    body = (per_layer + 2 * h * dtype.itemsize * layers) if checkpointing else per_layer * layers
    return body + h * dtype.itemsize + 16


def head_workspace_bytes(model_config, dtype: torch.dtype) -> int:
    """The chunked log-probs' largest working set (learners/logprobs.py): one chunk's logits in the
    matmul dtype, their fp32 copy and their fp32 gradient."""
    from learners.logprobs import default_chunk_rows

    vocab = model_config.vocab_size
    return default_chunk_rows(vocab) * vocab * (dtype.itemsize + 8)


def fitting_tokens(free_bytes: int, model_config, dtype: torch.dtype, checkpointing: bool,
                   needs: MemoryNeeds) -> int:
    """Tokens a micro-batch's activations may hold in `free_bytes` once `needs` are met (0 if none)."""
    usable = (free_bytes - needs.pending - needs.reserve - _SLACK) * _HEADROOM
    return max(0, int(usable // activation_bytes_per_token(model_config, dtype, checkpointing)))


def choose_micro_batch(free_bytes: int, model_config, dtype: torch.dtype, checkpointing: bool | str,
                       needs: MemoryNeeds, requested_tokens: int = 0, min_tokens: int = MIN_AUTO_TOKENS
                       ) -> tuple[int, bool]:
    """(micro-batch tokens, activation checkpointing) for `free_bytes` of device memory.

    Tokens: `requested_tokens` when set, else what fits (rounded down to a multiple of 1024, within
    [2048, 65536]). Checkpointing `auto`: off where the micro-batch fits without it (at least
    `requested_tokens`, else at least `min_tokens`), on where only checkpointing makes it fit."""
    def tokens(ckpt: bool) -> int:
        fit = fitting_tokens(free_bytes, model_config, dtype, ckpt, needs) // 1024 * 1024
        return max(2048, min(MAX_AUTO_TOKENS, fit))

    if checkpointing != "auto":
        return requested_tokens or tokens(bool(checkpointing)), bool(checkpointing)
    fit = fitting_tokens(free_bytes, model_config, dtype, False, needs)
    if fit >= (requested_tokens or min_tokens):
        return requested_tokens or tokens(False), False
    return requested_tokens or tokens(True), True


def default_micro_batch_tokens(model_config, device: torch.device, param_dtype: torch.dtype,
                               activation_checkpointing: bool, needs: MemoryNeeds | None = None) -> int:
    """Tokens per micro-batch. CPU: 8192. CUDA: what the device memory free now holds once `needs`
    are met (`choose_micro_batch`); without `needs` (a caller that knows nothing of the step's other
    memory) a quarter of it."""
    if device.type != "cuda":
        return 8192
    free, _ = torch.cuda.mem_get_info(device)
    if needs is None:
        per_token = activation_bytes_per_token(model_config, param_dtype, bool(activation_checkpointing))
        return max(2048, min(MAX_AUTO_TOKENS, int(free * 0.25 // per_token) // 1024 * 1024))
    return choose_micro_batch(free, model_config, param_dtype, bool(activation_checkpointing), needs)[0]


# ---- attention inside packed rows -----------------------------------------------------------------

@functools.cache
def _varlen_fn():
    """(varlen_attn, its parameter names), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A transformers attention function for one packed row: q (1, Hq, L, D), k/v (1, Hkv, L, D),
    sequence boundaries from `cu_seq_lens_q` / `max_length_q` (passed through the decoder's kwargs).
    Returns (1, L, Hq, D) as transformers' own attention functions do."""
    varlen_attn, params = _varlen_fn()
    cu, max_len = kwargs["cu_seq_lens_q"], int(kwargs["max_length_q"])
    q = query[0].transpose(0, 1).contiguous()
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    extra = {"scale": scaling}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu, cu, max_len, max_len, **extra)
    return out.unsqueeze(0), None


def _varlen_works(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny forward and backward through the varlen kernel (two sequences, GQA heads), checked
    against SDPA per sequence: a build without the kernel, or a wrong one, falls back to SDPA."""
    if _varlen_fn() is None:
        return False
    try:
        torch.manual_seed(0)
        q = torch.randn(1, 4, 24, 64, device=device, dtype=dtype, requires_grad=True)
        kv = torch.randn(2, 1, 2, 24, 64, device=device, dtype=dtype)
        cu = torch.tensor([0, 10, 24], dtype=torch.int32, device=device)
        out, _ = varlen_attention_forward(None, q, kv[0], kv[1], None, scaling=0.125, cu_seq_lens_q=cu, max_length_q=14)
        out.float().sum().backward()
        k, v = kv[0].repeat_interleave(2, dim=1), kv[1].repeat_interleave(2, dim=1)
        want = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=0.125) for a, b in ((0, 10), (10, 24))], 2)
        ok = torch.allclose(out.transpose(1, 2).float(), want.float(), atol=2e-2)
        if not ok:
            log.warning("FlashAttention varlen disagrees with SDPA on this device: packed rows use SDPA")
        return ok
    except Exception as e:  # a torch without the kernel for this device or dtype
        log.warning("FlashAttention varlen unavailable (%s): packed rows use SDPA", str(e).splitlines()[0][:200])
        return False


def packed_attention(model, device: torch.device, compute_dtype: torch.dtype) -> str:
    """Sets the attention that packed rows use on `model` (and every module sharing its config);
    returns its name: `asyncrl_varlen` where FlashAttention varlen runs (CUDA, 16-bit compute),
    else `sdpa` (transformers builds a block-diagonal causal mask from the position ids)."""
    name = "sdpa"
    if device.type == "cuda" and compute_dtype in (torch.bfloat16, torch.float16) and _varlen_works(device,
                                                                                                 compute_dtype):
        from transformers import AttentionInterface

        AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
        name = VARLEN_ATTENTION
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name
    return name
