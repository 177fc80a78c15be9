"""Token log-probs of a causal LM without the full B x T x V logits in fp32.

The decoder runs once for hidden states; the output projection, log-softmax and gather then run over
row chunks inside one autograd Function. Two ways through the backward:
- recompute (the default): no logits are kept; the backward recomputes each chunk's logits, so
  neither pass holds more than `chunk_rows x V` logits at once;
- keep (`keep_bytes` at least N x V in the matmul dtype): the forward writes every chunk's logits
  into one N x V buffer, the backward overwrites it chunk by chunk with the logit gradient and then
  makes two whole-batch matmuls (dh = G W, dW = G^T h). No recomputation, no per-chunk fp32 dW
  accumulation; the buffer is the only extra memory, never an fp32 copy of it.
On CUDA each chunk's log-sum-exp and its gradient are one compiled kernel each (one read of the
chunk). N = flattened rows, H = hidden size, V = vocabulary.

`with_entropy`: the exact entropy of each row's distribution, H = lse - sum_v p_v z_v, comes out
beside the log-probs from the same chunks (N more floats saved, never the N x V fp32 probabilities),
with its gradient dH/dz = -p * (log p + H) folded into the same backward pass over each chunk.

`micro_logprobs_sum_pi2` (no grad): the log-probs and each row's sum_v p_v^2 =
exp(logsumexp(2z) - 2 logsumexp(z)), chunk by chunk, for the optimal-token-baseline advantage.
"""

from __future__ import annotations

import types

import torch
from torch import nn

_METHOD = "asyncrl_token_logprobs"
_STATS_METHOD = "asyncrl_token_sum_pi2"
_CHUNK_BYTES = 1 << 30  # fp32 logits per chunk: about 1 GiB (1766 rows at V = 151936)


def default_chunk_rows(vocab_size: int) -> int:
    return max(64, _CHUNK_BYTES // (4 * vocab_size) // 64 * 64)


class ChunkedLinearLogprob(torch.autograd.Function):
    """logp[n] = log_softmax((h_NH / temperature) @ W_VH^T)[n, y_n], chunked over N in both passes.

    The forward saves each row's log-sum-exp (N floats) and, in the keep mode, the logits buffer.
    The output has the targets' shape (N rows in order) and is not a view, so it can be an FSDP2
    forward's return value."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, targets, temperature: float, chunk_rows: int,
                keep_bytes: int = 0, with_entropy: bool = False):
        ctx.set_materialize_grads(False)
        inv_t = 1.0 / temperature
        n_rows, vocab = hidden_NH.shape[0], weight_VH.shape[0]
        targets_N = targets.reshape(-1)
        out = torch.empty(targets.shape, dtype=torch.float32, device=hidden_NH.device)
        out_N = out.view(-1)
        lse_N = torch.empty(n_rows, dtype=torch.float32, device=hidden_NH.device)
        mm_dtype = torch.promote_types(hidden_NH.dtype, weight_VH.dtype)
        keep = any(ctx.needs_input_grad[:3]) and 0 < n_rows * vocab * mm_dtype.itemsize <= keep_bytes
        logits_NV = torch.empty(n_rows, vocab, dtype=mm_dtype, device=hidden_NH.device) if keep else None
        ent = torch.empty(targets.shape, dtype=torch.float32, device=hidden_NH.device) if with_entropy else None
        for i in range(0, n_rows, chunk_rows):
            rows = slice(i, i + chunk_rows)
            logits = _chunk_logits(hidden_NH[rows], weight_VH, bias_V, inv_t,
                                   out=logits_NV[rows] if keep else None)
            out_N[rows], lse_N[rows] = _logp_lse(logits, targets_N[rows])
            if with_entropy:
                ent.view(-1)[rows] = _entropy_eager(logits, lse_N[rows])
        ent_N = ent.view(-1) if with_entropy else None
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, targets_N, lse_N, ent_N)
        ctx.inv_t, ctx.chunk_rows, ctx.logits_NV = inv_t, chunk_rows, logits_NV
        return (out, ent) if with_entropy else out

    @staticmethod
    def backward(ctx, grad_out, grad_ent=None):
        hidden_NH, weight_VH, bias_V, targets_N, lse_N, ent_N = ctx.saved_tensors
        inv_t, chunk_rows, buf_NV = ctx.inv_t, ctx.chunk_rows, ctx.logits_NV
        ctx.logits_NV = None
        none = (None,) * 8
        if grad_out is None and grad_ent is None:
            return none
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_N = grad_out.reshape(-1).float() if grad_out is not None else \
            torch.zeros(hidden_NH.shape[0], dtype=torch.float32, device=hidden_NH.device)
        grad_ent_N = grad_ent.reshape(-1).float() if grad_ent is not None else None

        def grad_logits_(z, rows):
            if grad_ent_N is None:
                return _grad_logits_(z, lse_N[rows], targets_N[rows], grad_N[rows])
            return _grad_logits_entropy_(z, lse_N[rows], ent_N[rows], targets_N[rows], grad_N[rows], grad_ent_N[rows])

        if buf_NV is not None:
            for i in range(0, hidden_NH.shape[0], chunk_rows):
                rows = slice(i, i + chunk_rows)
                grad_logits_(buf_NV[rows], rows)
            # buf is now dlogp/dz for every row: one matmul each, accumulated in fp32 by the GEMM.
            h = hidden_NH * inv_t if inv_t != 1.0 else hidden_NH
            grad_h = ((buf_NV @ weight_VH) * inv_t).to(hidden_NH.dtype) if need_h else None
            grad_w = (buf_NV.t() @ h.to(buf_NV.dtype)).to(weight_VH.dtype) if need_w else None
            grad_b = (buf_NV.sum(0, dtype=torch.float32) * inv_t).to(bias_V.dtype) \
                if need_b and bias_V is not None else None
            return grad_h, grad_w, grad_b, None, None, None, None, None
        grad_h = torch.empty_like(hidden_NH) if need_h else None
        # Weight grads accumulate across chunks in fp32 so bf16 rounding happens once, not per chunk.
        grad_w = torch.zeros(weight_VH.shape, dtype=torch.float32, device=weight_VH.device) if need_w else None
        grad_b = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=weight_VH.device) \
            if need_b and bias_V is not None else None
        for i in range(0, hidden_NH.shape[0], chunk_rows):
            rows = slice(i, i + chunk_rows)
            h = hidden_NH[rows]
            grad_z = _chunk_logits(h, weight_VH, bias_V, inv_t)
            grad_logits_(grad_z, rows)
            if grad_h is not None:
                grad_h[rows] = (grad_z @ weight_VH) * inv_t
            if grad_w is not None:
                grad_w += grad_z.t() @ (h * inv_t)
            if grad_b is not None:
                grad_b += grad_z.float().sum(0) * inv_t
        if grad_w is not None:
            grad_w = grad_w.to(weight_VH.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias_V.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _logp_lse_eager(logits_cV: torch.Tensor, targets_c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(z)[y], logsumexp(z)) per row, in fp32, from z in the matmul dtype."""
    lse_c = torch.logsumexp(logits_cV.float(), dim=-1)
    return logits_cV.gather(1, targets_c[:, None]).squeeze(1).float() - lse_c, lse_c


def _grad_logits_eager(logits_cV, lse_c, targets_c, g_c) -> torch.Tensor:
    """Overwrites z with d(sum g * logp) / dz = g * (onehot(y) - softmax(z)), computed in fp32."""
    grad = torch.exp(logits_cV.float() - lse_c[:, None]) * (-g_c)[:, None]
    grad.scatter_add_(1, targets_c[:, None], g_c[:, None])
    return logits_cV.copy_(grad)


def _entropy_eager(logits_cV: torch.Tensor, lse_c: torch.Tensor) -> torch.Tensor:
    """H = lse - sum_v softmax(z)_v z_v per row, in fp32 (one chunk's fp32 copy at a time), on the
    max-shifted logits z - max z: H is shift-invariant, and unshifted logits near 40 would make it
    the difference of two numbers near 40 (6e-5 relative error in fp32 instead of ~1e-7)."""
    z = logits_cV.float()
    z = z - z.amax(dim=-1, keepdim=True)
    lse = torch.logsumexp(z, dim=-1)
    return lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)


def _grad_logits_entropy_(logits_cV, lse_c, ent_c, targets_c, g_c, gh_c) -> torch.Tensor:
    """Overwrites z with d(sum g * logp + gh * H) / dz = g * onehot(y) - p * (g + gh * (log p + H))."""
    z = logits_cV.float()
    logp = z - lse_c[:, None]
    grad = -torch.exp(logp) * (g_c[:, None] + gh_c[:, None] * (logp + ent_c[:, None]))
    grad.scatter_add_(1, targets_c[:, None], g_c[:, None])
    return logits_cV.copy_(grad)


def _grad_logits_fusable(logits_cV, lse_c, targets_c, g_c) -> torch.Tensor:
    # The one-hot as a comparison rather than a scatter, so the compiler makes one in-place pass over z.
    cols = torch.arange(logits_cV.shape[1], device=logits_cV.device)
    onehot = (cols[None, :] == targets_c[:, None]).float()
    return logits_cV.copy_((onehot - torch.exp(logits_cV.float() - lse_c[:, None])) * g_c[:, None])


_compiled: dict[str, object] = {}


def _fused(name: str, fn, eager, t: torch.Tensor):
    """On CUDA, `fn` under torch.compile: one read of the chunk's logits instead of several passes
    over fp32 copies of them. Elsewhere, or with `_compiled[name] = False`, the eager equivalent."""
    if t.device.type != "cuda" or _compiled.get(name) is False:
        return eager
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    return _compiled[name]


def _logp_lse(logits_cV, targets_c):
    return _fused("logp_lse", _logp_lse_eager, _logp_lse_eager, logits_cV)(logits_cV, targets_c)


def _grad_logits_(logits_cV, lse_c, targets_c, g_c):
    return _fused("grad_logits", _grad_logits_fusable, _grad_logits_eager, logits_cV)(logits_cV, lse_c,
                                                                                      targets_c, g_c)


def _chunk_logits(h_cH, weight_VH, bias_V, inv_t: float, out: torch.Tensor | None = None) -> torch.Tensor:
    # (h / t) W^T rather than (h W^T) / t: scales c x H values instead of c x V.
    h = h_cH * inv_t if inv_t != 1.0 else h_cH
    if out is None:
        logits = h @ weight_VH.t()
    else:
        logits = torch.matmul(h.to(out.dtype), weight_VH.t().to(out.dtype), out=out)
    if bias_V is not None:
        logits.add_(bias_V * inv_t)
    return logits


def linear_logprobs(hidden_BTH: torch.Tensor, weight_VH: torch.Tensor, targets_BT: torch.Tensor,
                    temperature: float, bias_V: torch.Tensor | None = None,
                    chunk_rows: int | None = None, rows_BT: torch.Tensor | None = None,
                    keep_logits_bytes: int = 0) -> torch.Tensor:
    """log softmax((hidden W^T + b) / temperature) at `targets`, fp32, shape B x T.

    `rows_BT`: compute only those positions (the completion tokens), given as a bool B x T mask or
    as flat int64 indices into B x T (no device sync); the others are 0. `keep_logits_bytes`: keep
    the logits for the backward instead of recomputing them when all of them fit in this many bytes."""
    chunk_rows = chunk_rows or default_chunk_rows(weight_VH.shape[0])
    flat_NH = hidden_BTH.reshape(-1, hidden_BTH.shape[-1])
    if rows_BT is None:
        return ChunkedLinearLogprob.apply(flat_NH, weight_VH, bias_V, targets_BT, temperature, chunk_rows,
                                          keep_logits_bytes)
    idx_N = _flat_index(rows_BT)
    return _picked_logprobs(flat_NH, idx_N, targets_BT.reshape(-1).index_select(0, idx_N), idx_N, targets_BT.shape,
                            weight_VH, bias_V, temperature, chunk_rows, keep_logits_bytes)


def _flat_index(rows_BT: torch.Tensor) -> torch.Tensor:
    return rows_BT if rows_BT.dtype == torch.long else rows_BT.reshape(-1).nonzero().squeeze(1)


def _picked_logprobs(flat_NH, src_idx, targets_n, out_idx, shape, weight_VH, bias_V, temperature, chunk_rows,
                     keep_logits_bytes) -> torch.Tensor:
    """Log-probs of the rows `src_idx` of `flat_NH` (targets `targets_n`), written at `out_idx` of a
    zero tensor of `shape`."""
    picked = ChunkedLinearLogprob.apply(flat_NH.index_select(0, src_idx), weight_VH, bias_V, targets_n, temperature,
                                        chunk_rows, keep_logits_bytes)
    out = torch.zeros(shape.numel(), dtype=picked.dtype, device=picked.device)
    return out.index_copy(0, out_idx, picked).view(shape)


def _output_head(model: nn.Module) -> nn.Linear:
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"chunked log-probs need a Linear output head, {type(model).__name__} has "
                         f"{type(head).__name__}; compute log-probs from model(...).logits instead")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits (final_logit_softcapping), which the "
                         "chunked log-probs do not apply; compute them from model(...).logits instead")
    return head


def _token_logprobs_forward(self: nn.Module, input_ids_BL, attention_mask_BL, temperature: float,
                            chunk_rows: int | None = None, rows_BT: torch.Tensor | None = None,
                            keep_logits_bytes: int = 0, position_ids_BL: torch.Tensor | None = None,
                            attn_kwargs: dict | None = None, flat: bool = False, with_entropy: bool = False):
    # Runs as an FSDP2 forward method: the root's parameters (embeddings, final norm, output head; a
    # tied head shares the embedding weight) are unsharded here and their grads reduced afterwards.
    head = _output_head(self)
    hidden_BLH = self.get_decoder()(input_ids=input_ids_BL, attention_mask=attention_mask_BL,
                                    position_ids=position_ids_BL, use_cache=False,
                                    **(attn_kwargs or {})).last_hidden_state
    if rows_BT is None:
        return linear_logprobs(hidden_BLH[:, :-1], head.weight, input_ids_BL[:, 1:], temperature, head.bias,
                               chunk_rows, None, keep_logits_bytes)
    # Rows picked straight from the contiguous B x L hidden states: position (b, t) of the B x T grid
    # (T = L - 1) is row b * L + t, and its target token is at b * L + t + 1.
    B, L, H = hidden_BLH.shape
    idx_N = _flat_index(rows_BT)
    idx_BL = idx_N + idx_N // (L - 1)
    chunk_rows = chunk_rows or default_chunk_rows(head.weight.shape[0])
    targets_n = input_ids_BL.reshape(-1).index_select(0, idx_BL + 1)
    if flat:
        return ChunkedLinearLogprob.apply(hidden_BLH.reshape(-1, H).index_select(0, idx_BL), head.weight, head.bias,
                                          targets_n, temperature, chunk_rows, keep_logits_bytes, with_entropy)
    assert not with_entropy, "the entropy comes with flat=True log-probs"
    return _picked_logprobs(hidden_BLH.reshape(-1, H), idx_BL, targets_n, idx_N, torch.Size((B, L - 1)), head.weight,
                            head.bias, temperature, chunk_rows, keep_logits_bytes)


def sequence_logprobs(model: nn.Module, input_ids_BL: torch.Tensor, attention_mask_BL: torch.Tensor | None,
                      temperature: float, chunk_rows: int | None = None, rows_BT: torch.Tensor | None = None,
                      keep_logits_bytes: int = 0, position_ids_BL: torch.Tensor | None = None,
                      attn_kwargs: dict | None = None, flat: bool = False, with_entropy: bool = False):
    """logp_BT[b, j] = log pi(input_ids[b, j+1] | input_ids[b, :j+1]) at `temperature`, for a Hugging
    Face causal LM (plain or FSDP2-wrapped), without materialising B x T x V logits. With `rows_BT`
    (a bool B x T mask, or flat int64 indices into B x T: `Batch.loss_rows`) only those positions
    are computed (the rest are 0): the learner passes its loss positions, so the output head never
    runs on prompt or padding positions. `flat`: return just those positions' log-probs, in the
    order of `rows_BT` (int64 indices). `position_ids_BL` / `attn_kwargs`: packed rows
    (learners/batch.py `MicroBatch`). `with_entropy` (with `flat`): (log-probs, exact entropies)."""
    method = getattr(model, _METHOD, None)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        # Attached once per model; with FSDP2 the method gets the root's pre/post-forward hooks, as
        # `generate` does. A no-op registration for a model that is not FSDP-wrapped.
        setattr(model, _METHOD, types.MethodType(_token_logprobs_forward, model))
        register_fsdp_forward_method(model, _METHOD)
        method = getattr(model, _METHOD)
    return method(input_ids_BL, attention_mask_BL, temperature, chunk_rows, rows_BT, keep_logits_bytes,
                  position_ids_BL, attn_kwargs, flat, with_entropy)


def micro_logprobs(model: nn.Module, mb, temperature: float, keep_logits_bytes: int = 0,
                   with_entropy: bool = False):
    """Log-probs of a micro-batch's completion tokens (learners/batch.py `MicroBatch`), flat, in
    the order of its `flat_N`; with `with_entropy`, (log-probs, exact entropies)."""
    return sequence_logprobs(model, mb.input_ids, mb.attention_mask, temperature, rows_BT=mb.rows,
                             keep_logits_bytes=keep_logits_bytes, position_ids_BL=mb.position_ids,
                             attn_kwargs=mb.attn_kwargs, flat=True, with_entropy=with_entropy)


def _sum_pi2_forward(self: nn.Module, input_ids_BL, attention_mask_BL, temperature: float, rows_BT: torch.Tensor,
                     position_ids_BL: torch.Tensor | None = None, attn_kwargs: dict | None = None) -> torch.Tensor:
    """n x 2 (log-prob of the target, sum_v p_v^2) at the flat positions `rows_BT`, no grad."""
    head = _output_head(self)
    hidden_BLH = self.get_decoder()(input_ids=input_ids_BL, attention_mask=attention_mask_BL,
                                    position_ids=position_ids_BL, use_cache=False,
                                    **(attn_kwargs or {})).last_hidden_state
    B, L, H = hidden_BLH.shape
    idx_N = _flat_index(rows_BT)
    idx_BL = idx_N + idx_N // (L - 1)
    hidden_nH = hidden_BLH.reshape(-1, H).index_select(0, idx_BL)
    targets_n = input_ids_BL.reshape(-1).index_select(0, idx_BL + 1)
    out = torch.empty((idx_N.numel(), 2), dtype=torch.float32, device=hidden_BLH.device)
    chunk = default_chunk_rows(head.weight.shape[0])
    for start in range(0, idx_N.numel(), chunk):
        rows = slice(start, start + chunk)
        z = _chunk_logits(hidden_nH[rows], head.weight, head.bias, 1.0 / temperature).float()
        lse = torch.logsumexp(z, dim=-1)
        out[rows, 0] = z.gather(1, targets_n[rows, None]).squeeze(1) - lse
        out[rows, 1] = torch.exp(torch.logsumexp(2 * z, dim=-1) - 2 * lse)
    return out


@torch.no_grad()
def micro_logprobs_sum_pi2(model: nn.Module, mb, temperature: float) -> torch.Tensor:
    """A micro-batch's completion tokens (in the order of its `flat_N`): n x 2, the log-prob of each
    token and its distribution's sum_v p_v^2, both at `temperature`, without N x V logits."""
    method = getattr(model, _STATS_METHOD, None)
    if method is None:
        from torch.distributed.fsdp import register_fsdp_forward_method

        setattr(model, _STATS_METHOD, types.MethodType(_sum_pi2_forward, model))
        register_fsdp_forward_method(model, _STATS_METHOD)
        method = getattr(model, _STATS_METHOD)
    return method(mb.input_ids, mb.attention_mask, temperature, mb.rows, mb.position_ids, mb.attn_kwargs)
