"""Turning trajectory groups into padded training tensors (B = sequences, L = prompt + completion)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl import schema


@dataclass
class Batch:
    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    # Aligned with the logits at positions 0..L-2, i.e. predicting tokens 1..L-1:
    targets_BT: torch.Tensor
    loss_mask_BT: torch.Tensor
    behav_logp_BT: torch.Tensor
    versions_BT: torch.Tensor
    rewards_B: torch.Tensor
    group_size: int = 0  # samples per group; 0 when groups differ in size
    # Flat indices into B x T of the loss-mask positions, made on the host so that picking those rows
    # on the device needs no device-to-host sync (learners/logprobs.py).
    loss_index_N: torch.Tensor | None = None

    @property
    def loss_rows(self) -> torch.Tensor:
        return self.loss_mask_BT if self.loss_index_N is None else self.loss_index_N

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask_BT.sum())


def build_batch(groups: list[schema.TrajectoryGroup], pad_id: int, device) -> Batch:
    """Advantages are not computed here: learners/step.py derives them from rewards_B per
    algorithm.advantage."""
    seqs, masks, behav, vers, rewards = [], [], [], [], []
    for g in groups:
        prompt = schema.unpack_i32(g.prompt_ids)
        for s in g.samples:
            comp = schema.unpack_i32(s.completion_ids)
            seqs.append(np.concatenate([prompt, comp]))
            # Token j of the sequence is predicted at position j-1; completion tokens start at len(prompt).
            masks.append((len(prompt), len(comp)))
            behav.append(schema.unpack_f32(s.logprobs))
            vers.append(schema.unpack_i32(s.versions))
            rewards.append(s.reward)
    B, L = len(seqs), max(len(x) for x in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    loss_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    behav_t = torch.zeros((B, L - 1), dtype=torch.float32)
    vers_t = torch.zeros((B, L - 1), dtype=torch.long)
    for i, seq in enumerate(seqs):
        input_ids[i, : len(seq)] = torch.from_numpy(seq.astype(np.int64))
        attn[i, : len(seq)] = 1
        start, n = masks[i]
        loss_mask[i, start - 1: start - 1 + n] = 1
        behav_t[i, start - 1: start - 1 + n] = torch.from_numpy(behav[i].copy())
        vers_t[i, start - 1: start - 1 + n] = torch.from_numpy(vers[i].astype(np.int64))
    return Batch(input_ids_BL=input_ids.to(device), attention_mask_BL=attn.to(device),
                 targets_BT=input_ids[:, 1:].to(device), loss_mask_BT=loss_mask.to(device),
                 behav_logp_BT=behav_t.to(device), versions_BT=vers_t.to(device),
                 rewards_B=torch.tensor(rewards, device=device),
                 loss_index_N=loss_mask.reshape(-1).nonzero().squeeze(1).to(device),
                 group_size=sizes.pop() if len(sizes := {len(g.samples) for g in groups}) == 1 else 0)
