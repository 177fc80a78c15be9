"""learner.kernel_warmup: one training step on synthetic groups before the first real batch.

A learner's first step on a GPU costs seconds more than the next ones (kernel selection and
autotuning, the caching allocator's first growth, the fused optimizer's first launch). The learner is
ready long before the generators' engines are, so it takes that step while it would wait anyway: on
groups of the run's shape (`learner.batch_groups` x `generator.n` samples of `generator.max_tokens`
tokens) made of random tokens, with every learning rate at 0, so that the weights do not move. The
optimizers' state is then emptied (it holds the synthetic gradients' moments; a fresh optimizer holds
nothing either), and the schedules, their learning rates, the KL controller and the random number
generators are put back as they were: the first real step is the one it would have been without the
warm-up. What the step's memory grew to is handed back to the device afterwards.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from asyncrl.protocol import schema

WARMUP_PROMPT_TOKENS = 64  # a typical chat-template prompt; the generated tokens are max_tokens each


def synthetic_groups(num_groups: int, n: int, prompt_tokens: int, completion_tokens: int, vocab_size: int,
                     seed: int = 0) -> list[schema.TrajectoryGroup]:
    """`num_groups` groups of `n` samples of random tokens, rewards alternating 0 and 1 within a group
    (so that advantages, and the gradient, are not zero), each with a greedy baseline reward (what
    advantage=remax needs; the other estimators ignore it)."""
    rng = np.random.default_rng(seed)
    low = min(3, vocab_size - 1)  # keep clear of the usual special ids at the bottom of the vocabulary
    groups = []
    for g in range(num_groups):
        samples = [schema.Sample(completion_ids=schema.pack_i32(rng.integers(low, vocab_size, completion_tokens).tolist()),
                                 logprobs=schema.pack_f32([-1.0] * completion_tokens),
                                 versions=schema.pack_i32([0] * completion_tokens), reward=float(i % 2))
                   for i in range(n)]
        groups.append(schema.TrajectoryGroup(
            schema_version=schema.SCHEMA_VERSION, group_id=f"warmup-{g}", prompt_id=f"warmup-{g}",
            generator_id="warmup", prompt_ids=schema.pack_i32(rng.integers(low, vocab_size, prompt_tokens).tolist()),
            samples=samples, sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=0.0, baseline_reward=0.5))
    return groups


@contextmanager
def frozen_training_state(optimizers: list[torch.optim.Optimizer], schedulers: list, kl_ctl) -> Iterator[None]:
    """Every learning rate 0 inside; afterwards the optimizers' state emptied and their gradients
    dropped, the schedulers, the learning rates, `kl_ctl` and torch's random number generators (CPU
    and CUDA: a loss or LoRA's dropout may draw from them) as they were before, and the CUDA caching
    allocator's free blocks handed back (a vLLM engine on the same GPU may be sizing its KV cache)."""
    if any(opt.state for opt in optimizers):
        raise RuntimeError("learner.kernel_warmup runs before the first step only: an optimizer already holds state")
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    lrs = [[pg["lr"] for pg in opt.param_groups] for opt in optimizers]
    sched_states = [s.state_dict() for s in schedulers]
    kl_state = copy.deepcopy(kl_ctl.__dict__)
    lambdas = []
    for s in schedulers:  # the schedule's factor is what sets each update's rate: hold it at 0
        lambdas.append(s.lr_lambdas)
        s.lr_lambdas = [lambda _step: 0.0] * len(s.lr_lambdas)
    for opt in optimizers:
        for pg in opt.param_groups:
            pg["lr"] = 0.0
    try:
        yield
    finally:
        for s, fns, state in zip(schedulers, lambdas, sched_states, strict=True):
            s.lr_lambdas = fns
            s.load_state_dict(state)
        for opt, group_lrs in zip(optimizers, lrs, strict=True):
            opt.state.clear()
            opt.zero_grad(set_to_none=True)
            for pg, lr in zip(opt.param_groups, group_lrs, strict=True):
                pg["lr"] = lr
        kl_ctl.__dict__.update(kl_state)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
