"""Loss aggregation: pure functions on tensors, shapes in the names.

B = sequences in the batch, T = completion tokens (padded). Advantages are in asyncrl/algorithms/advantages.py,
policy losses in asyncrl/algorithms/losses.py.

Every aggregation is registered (asyncrl/registry.py AGGREGATIONS) in its normalised form: a part's
(micro-batch's, rank's) share of the loss of a larger batch of `num_tokens` valid tokens and
`num_seqs` sequences that it is a slice of, so that the parts' sum is the aggregate of the whole
whatever the split (whole sequences per part). `norm_tokens` is the constant of
seq_mean_token_sum_norm (algorithm.loss_norm_tokens, default generator.max_tokens).
"""

from __future__ import annotations

import torch

from asyncrl.registry import AGGREGATIONS


@AGGREGATIONS.register("token_mean", ref="DAPO (arXiv:2503.14476)")
def _token_mean(loss_BT, mask_BT, num_tokens: int, num_seqs: int, norm_tokens: int) -> torch.Tensor:
    """Mean over every valid token of the batch: long sequences weigh more."""
    return (loss_BT * mask_BT).sum() / max(num_tokens, 1)


@AGGREGATIONS.register("seq_mean_token_mean", ref="GRPO (arXiv:2402.03300)")
def _seq_mean_token_mean(loss_BT, mask_BT, num_tokens: int, num_seqs: int, norm_tokens: int) -> torch.Tensor:
    """Mean over each sequence's tokens, then over sequences: every sequence weighs the same."""
    return ((loss_BT * mask_BT).sum(dim=1) / mask_BT.sum(dim=1).clamp(min=1)).sum() / max(num_seqs, 1)


@AGGREGATIONS.register("seq_mean_token_sum", ref="verl agg_loss")
def _seq_mean_token_sum(loss_BT, mask_BT, num_tokens: int, num_seqs: int, norm_tokens: int) -> torch.Tensor:
    """Sum over each sequence's tokens, mean over sequences."""
    return (loss_BT * mask_BT).sum() / max(num_seqs, 1)


@AGGREGATIONS.register("seq_mean_token_sum_norm", ref="Dr. GRPO (arXiv:2503.20783)")
def _seq_mean_token_sum_norm(loss_BT, mask_BT, num_tokens: int, num_seqs: int, norm_tokens: int) -> torch.Tensor:
    """Token sum over a constant (the generation budget), mean over sequences: Dr. GRPO's unbiased normaliser."""
    return (loss_BT * mask_BT).sum() / (max(num_seqs, 1) * max(norm_tokens, 1))


@AGGREGATIONS.register("token_sum", ref="REINFORCE (Williams, 1992)")
def _token_sum(loss_BT, mask_BT, num_tokens: int, num_seqs: int, norm_tokens: int) -> torch.Tensor:
    """Sum over every valid token, unnormalised: the gradient scales with the batch."""
    return (loss_BT * mask_BT).sum()


def aggregate_normalised(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, num_tokens: int,
                         num_seqs: int, norm_tokens: int = 1) -> torch.Tensor:
    """This part's share of `mode` (algorithm.aggregation) over a larger batch of `num_tokens` valid
    tokens and `num_seqs` sequences that it is a slice of (a micro-batch of a mini-batch, one rank's
    part): sum the parts and get the aggregate of the whole, whatever the split (whole sequences per part)."""
    return AGGREGATIONS.get(mode).fn(loss_BT, mask_BT, num_tokens, num_seqs, norm_tokens)
