"""Turning trajectory groups into training tensors.

`build_step` holds a learner step's sequences on every rank, with per-token arrays flat over the
completion tokens of all of them (N, in sequence order; a multi-turn episode's completion is every
token after its prompt, observations included, and `mask_N` marks the policy's own: only those are
trained on, counted or averaged over); `micro_batch` makes the model inputs of a
few of them, packed in one row or padded, and maps its rows back into N. `build_batch` is the
padded whole-batch form (B = sequences, L = prompt + completion) that log-prob tests use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.protocol import schema


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


@dataclass
class StepBatch:
    """A learner step's sequences (S of them, groups in order) on every rank. Per-token arrays are
    flat over the completion tokens of all sequences (N): sequence s owns [comp_start[s],
    comp_start[s] + comp_len[s])."""

    tokens: list[np.ndarray]  # prompt + completion ids of each sequence
    prompt_len: list[int]
    comp_len: list[int]
    group_sizes: list[int]
    rewards_S: torch.Tensor
    behav_N: torch.Tensor
    versions_N: torch.Tensor
    seq_of_N: torch.Tensor  # the sequence each completion token belongs to
    comp_start: list[int]
    device: torch.device
    micro_cache: dict = field(default_factory=dict)  # learners.batch.micro_batch's, for this step
    baselines_G: torch.Tensor | None = None  # each group's greedy baseline reward; None unless every group has one
    # 1 for the tokens the policy sampled, 0 for observation tokens of multi-turn episodes (host copy:
    # micro-batches are built from it without a device sync). None: every token is the policy's.
    policy_mask_np: np.ndarray | None = None

    @property
    def mask_N(self) -> torch.Tensor:
        """1.0 for each policy token of N, 0.0 for each observation token (float32, on the device)."""
        if getattr(self, "_mask_N", None) is None:
            m = np.ones(self.num_tokens, np.float32) if self.policy_mask_np is None else self.policy_mask_np
            self._mask_N = torch.from_numpy(m.astype(np.float32)).to(self.device)
        return self._mask_N

    @property
    def policy_len(self) -> list[int]:
        """Policy tokens of each sequence (its completion length for single-turn groups)."""
        if self.policy_mask_np is None:
            return list(self.comp_len)
        return [int(self.policy_mask_np[a:a + n].sum()) for a, n in zip(self.comp_start, self.comp_len, strict=True)]

    @property
    def num_policy_tokens(self) -> int:
        return self.num_tokens if self.policy_mask_np is None else int(self.policy_mask_np.sum())

    @property
    def policy(self) -> PolicyView:
        """The step's policy tokens alone, as a grid without holes (advantages, returns, corrections)."""
        if getattr(self, "_policy", None) is None:
            self._policy = PolicyView(self)
        return self._policy

    @property
    def num_seqs(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        """Completion tokens of the step (what the loss sees)."""
        return int(self.behav_N.numel())

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def group_size(self) -> int:
        """Samples per group; 0 when groups differ in size."""
        return sizes.pop() if len(sizes := set(self.group_sizes)) == 1 else 0

    def grid(self, flat_N: torch.Tensor) -> torch.Tensor:
        """S x Tmax (Tmax = the longest completion), zero past each sequence's end."""
        out = torch.zeros(self.num_seqs * self.max_comp, dtype=flat_N.dtype, device=flat_N.device)
        return out.index_copy(0, self.grid_index_N, flat_N).view(self.num_seqs, self.max_comp)

    def flat(self, grid_ST: torch.Tensor) -> torch.Tensor:
        return grid_ST.reshape(-1).index_select(0, self.grid_index_N)

    @property
    def max_comp(self) -> int:
        return max(self.comp_len, default=0)

    @property
    def grid_index_N(self) -> torch.Tensor:
        if getattr(self, "_grid_index", None) is None:
            comp = np.asarray(self.comp_len, dtype=np.int64)
            idx = _ranges(np.arange(len(comp)) * self.max_comp, comp)
            self._grid_index = torch.from_numpy(idx).to(self.device)
        return self._grid_index


class PolicyView:
    """The policy tokens of a step, each sequence's in order with the observation tokens left out:
    S x P grids (P = the most policy tokens of a sequence) with no holes, so that returns run across
    an episode's turns as they do along a single completion. `grid` takes N values (observation
    tokens' ignored), `flat` gives N values back (0 at observation tokens). Single-turn steps: the
    same as StepBatch.grid / flat."""

    def __init__(self, step: StepBatch):
        self.step = step
        if step.policy_mask_np is None:
            self.index_P = None
            return
        self.index_P = torch.from_numpy(np.flatnonzero(step.policy_mask_np)).to(step.device)
        lens = np.asarray(step.policy_len, dtype=np.int64)
        self.width = int(lens.max()) if len(lens) else 0
        self.grid_index_P = torch.from_numpy(_ranges(np.arange(len(lens)) * self.width, lens)).to(step.device)

    def grid(self, flat_N: torch.Tensor) -> torch.Tensor:
        if self.index_P is None:
            return self.step.grid(flat_N)
        out = torch.zeros(self.step.num_seqs * self.width, dtype=flat_N.dtype, device=flat_N.device)
        out.index_copy_(0, self.grid_index_P, flat_N.index_select(0, self.index_P))
        return out.view(self.step.num_seqs, self.width)

    def flat(self, grid_SP: torch.Tensor) -> torch.Tensor:
        if self.index_P is None:
            return self.step.flat(grid_SP)
        out = torch.zeros(self.step.num_tokens, dtype=grid_SP.dtype, device=grid_SP.device)
        return out.index_copy_(0, self.index_P, grid_SP.reshape(-1).index_select(0, self.grid_index_P))

    def mask(self) -> torch.Tensor:
        """S x P, 1.0 at each sequence's policy tokens."""
        return self.grid(self.step.mask_N)


def build_step(groups: list[schema.TrajectoryGroup], device) -> StepBatch:
    tokens, prompt_len, comp_len, behav, vers, rewards, seq_of = [], [], [], [], [], [], []
    masks, multi_turn = [], any(s.loss_mask for g in groups for s in g.samples)
    for g in groups:
        prompt = schema.unpack_i32(g.prompt_ids)
        for s in g.samples:
            if multi_turn:
                masks.append(s.policy_mask())
            comp = schema.unpack_i32(s.completion_ids)
            tokens.append(np.concatenate([prompt, comp]).astype(np.int64))
            prompt_len.append(len(prompt))
            comp_len.append(len(comp))
            behav.append(schema.unpack_f32(s.logprobs))
            vers.append(schema.unpack_i32(s.versions))
            seq_of.append(np.full(len(comp), len(tokens) - 1, dtype=np.int64))
            rewards.append(s.reward)
    starts = np.concatenate([[0], np.cumsum(comp_len)[:-1]]).astype(int).tolist() if comp_len else []

    def cat(xs, dt):
        return torch.from_numpy(np.concatenate(xs).astype(dt)) if xs else torch.zeros(0)

    baselines = [g.baseline_reward for g in groups]
    baselines_G = (torch.tensor(baselines, dtype=torch.float32, device=device)
                   if groups and None not in baselines else None)
    return StepBatch(tokens=tokens, prompt_len=prompt_len, comp_len=comp_len,
                     group_sizes=[len(g.samples) for g in groups], baselines_G=baselines_G,
                     rewards_S=torch.tensor(rewards, dtype=torch.float32, device=device),
                     behav_N=cat(behav, np.float32).to(device), versions_N=cat(vers, np.int64).to(device),
                     seq_of_N=cat(seq_of, np.int64).to(device), comp_start=starts, device=torch.device(device),
                     policy_mask_np=np.concatenate(masks).astype(np.uint8) if multi_turn else None)


@dataclass
class MicroBatch:
    """The model inputs of a few sequences of a step and where their completion tokens go.

    `input_ids` is 1 x L (packed: sequences back to back, `position_ids` restarting at each, and
    `attn_kwargs` with the sequence boundaries for varlen attention) or b x L (padded, with
    `attention_mask`). `rows` are flat indices into the (rows x (L-1)) grid of next-token
    positions that predict completion tokens, in the order of `flat_N` (their indices into the
    step's N arrays). Loss tensors are b x T (`grid`): T the longest completion of the micro-batch;
    `mask_bT` is 1.0 at its policy tokens (observation tokens of episodes are 0: they are computed in
    the forward pass, as context, but never weigh in a loss, a count or a mean)."""

    seqs: list[int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    attn_kwargs: dict
    rows: torch.Tensor
    flat_N: torch.Tensor
    grid_index: torch.Tensor
    mask_bT: torch.Tensor

    num_policy: int = -1  # policy tokens; -1: every completion token is one

    @property
    def num_tokens(self) -> int:
        """Completion tokens in the loss (the policy's)."""
        if not self.seqs:
            return 0
        return int(self.rows.numel()) if self.num_policy < 0 else self.num_policy

    def grid(self, flat_n: torch.Tensor) -> torch.Tensor:
        b, t = self.mask_bT.shape
        out = torch.zeros(b * t, dtype=flat_n.dtype, device=flat_n.device)
        return out.index_copy(0, self.grid_index, flat_n).view(b, t)


def micro_batch(step: StepBatch, seqs: list[int], packed: bool, pad_id: int) -> MicroBatch:
    """Inputs for `seqs` (indices into the step), made once per step: the reference, proximal,
    critic and training passes over the same micro-batch reuse them. Empty `seqs`: one two-token
    row of padding whose single position is computed but weighs nothing (a rank with nothing to do
    still runs the forward and backward that FSDP's collectives need)."""
    key = (tuple(seqs), packed, pad_id)
    if key not in step.micro_cache:
        step.micro_cache[key] = _micro_batch(step, seqs, packed, pad_id)
    return step.micro_cache[key]


def _micro_batch(step: StepBatch, seqs: list[int], packed: bool, pad_id: int) -> MicroBatch:
    mb = _micro_inputs(step, seqs, packed, pad_id)
    if step.policy_mask_np is None or not seqs:
        return mb
    # Observation tokens stay in the inputs (the policy reads them) but leave the loss mask.
    comp = np.array([step.comp_len[s] for s in seqs], dtype=np.int64)
    flat = _ranges(np.array([step.comp_start[s] for s in seqs], dtype=np.int64), comp)  # mb.flat_N, on the host
    policy = step.policy_mask_np[flat].astype(np.float32)
    mask = np.zeros(mb.mask_bT.numel(), np.float32)
    mask[_ranges(np.arange(len(seqs)) * mb.mask_bT.shape[1], comp)] = policy  # mb.grid_index
    mb.mask_bT = _h2d(torch.from_numpy(mask).view(mb.mask_bT.shape), step.device)
    mb.num_policy = int(policy.sum())
    return mb


def _micro_inputs(step: StepBatch, seqs: list[int], packed: bool, pad_id: int) -> MicroBatch:
    dev = step.device
    if not seqs:
        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=dev)
        pos = torch.arange(2, device=dev)[None]
        cu = torch.tensor([0, 2], dtype=torch.int32, device=dev)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        return MicroBatch(seqs=[], input_ids=ids, attention_mask=None if packed else torch.ones_like(ids),
                          position_ids=pos if packed else None,
                          attn_kwargs={"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 2, "max_length_k": 2}
                          if packed else {}, rows=zero, flat_N=zero if step.num_tokens else zero[:0],
                          grid_index=zero, mask_bT=torch.zeros((1, 1), device=dev))
    comp = np.array([step.comp_len[s] for s in seqs], dtype=np.int64)
    prompt = np.array([step.prompt_len[s] for s in seqs], dtype=np.int64)
    t_max = max(int(comp.max()), 1)
    grid_index = _ranges(np.arange(len(seqs)) * t_max, comp)
    flat = _ranges(np.array([step.comp_start[s] for s in seqs], dtype=np.int64), comp)
    lens = np.array([len(step.tokens[s]) for s in seqs], dtype=np.int64)
    if packed:
        ids = np.concatenate([step.tokens[s] for s in seqs])
        total = len(ids)
        offsets = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        pos = np.arange(total) - np.repeat(offsets, lens)
        # Completion token j of a sequence at row offset o sits at o + prompt + j and is predicted
        # at o + prompt + j - 1; rows index the 1 x (L-1) grid of predicting positions.
        rows = _ranges(offsets + prompt - 1, comp)
        cu = _h2d(torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)), dev)
        return MicroBatch(seqs=list(seqs), input_ids=_h2d(torch.from_numpy(ids)[None], dev), attention_mask=None,
                          position_ids=_h2d(torch.from_numpy(pos)[None], dev),
                          attn_kwargs={"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(lens.max()),
                                       "max_length_k": int(lens.max())},
                          rows=_tensor(rows, dev), flat_N=_tensor(flat, dev), grid_index=_tensor(grid_index, dev),
                          mask_bT=_mask(comp, t_max, dev))
    L = int(lens.max())
    ids = np.full((len(seqs), L), pad_id, dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : lens[i]] = step.tokens[s]
    attn = (np.arange(L)[None, :] < lens[:, None]).astype(np.int64)
    rows = _ranges(np.arange(len(seqs)) * (L - 1) + prompt - 1, comp)
    return MicroBatch(seqs=list(seqs), input_ids=_h2d(torch.from_numpy(ids), dev),
                      attention_mask=_h2d(torch.from_numpy(attn), dev), position_ids=None, attn_kwargs={},
                      rows=_tensor(rows, dev), flat_N=_tensor(flat, dev), grid_index=_tensor(grid_index, dev),
                      mask_bT=_mask(comp, t_max, dev))


def _ranges(bases: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """concat(arange(b, b + n) for b, n in zip(bases, counts)), without a Python loop."""
    counts = np.asarray(counts, dtype=np.int64)
    excl = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return np.repeat(np.asarray(bases, dtype=np.int64) - excl, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def _h2d(t: torch.Tensor, dev) -> torch.Tensor:
    """A host tensor on `dev` without waiting for the device: a copy from pageable memory waits for
    every kernel queued before it (the GPU drains at each micro-batch); one from pinned memory is
    queued behind them, and the pinned buffer is not reused before the copy is done."""
    if torch.device(dev).type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _tensor(a: np.ndarray, dev) -> torch.Tensor:
    return _h2d(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), dev)


def _mask(comp: np.ndarray, t_max: int, dev) -> torch.Tensor:
    return _h2d(torch.from_numpy((np.arange(t_max)[None, :] < np.asarray(comp)[:, None]).astype(np.float32)), dev)
