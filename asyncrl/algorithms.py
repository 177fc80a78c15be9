"""Loss aggregation and token log-probs: pure functions on tensors, shapes in the names.

B = sequences in the batch, T = completion tokens (padded). Advantages are in asyncrl/advantages.py,
policy losses in asyncrl/losses.py.
"""

from __future__ import annotations

import torch


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """token_mean: mean over all tokens; seq_mean_token_mean: per-sequence mean, then mean over
    sequences; seq_mean_token_sum: per-sequence sum, then mean over sequences."""
    if mode == "token_mean":
        return masked_mean(loss_BT, mask_BT)
    per_seq_sum_B = (loss_BT * mask_BT).sum(dim=1)
    if mode == "seq_mean_token_sum":
        return per_seq_sum_B.mean()
    if mode == "seq_mean_token_mean":
        return (per_seq_sum_B / mask_BT.sum(dim=1).clamp(min=1)).mean()
    raise ValueError(f"unknown loss aggregation {mode!r}")


def aggregate_normalised(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, num_tokens: int,
                         num_seqs: int) -> torch.Tensor:
    """This part's share of `aggregate` over a larger batch of `num_tokens` valid tokens and
    `num_seqs` sequences that it is a slice of (a micro-batch of a mini-batch, one rank's part):
    sum the parts and get `aggregate` of the whole, whatever the split (whole sequences per part)."""
    masked = loss_BT * mask_BT
    if mode == "token_mean":
        return masked.sum() / max(num_tokens, 1)
    if mode == "seq_mean_token_sum":
        return masked.sum() / max(num_seqs, 1)
    if mode == "seq_mean_token_mean":
        return (masked.sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)).sum() / max(num_seqs, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}")


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float,
                   chunk: int = 1024) -> torch.Tensor:
    """log softmax(logits / temperature) at `targets`, computed in fp32 over row chunks so the full
    B x T x V fp32 tensor is never materialised at once."""
    flat = logits_BTV.reshape(-1, logits_BTV.shape[-1])
    tgt = targets_BT.reshape(-1)
    out = []
    for i in range(0, flat.shape[0], chunk):
        rows = flat[i:i + chunk].float() / temperature
        out.append(rows.gather(1, tgt[i:i + chunk, None]).squeeze(1) - torch.logsumexp(rows, dim=-1))
    return torch.cat(out).view_as(targets_BT)
