"""Mini-batches, token-budget micro-batches and packing (learners/packing.py, learners/step.py):
every split of a step gives the update the whole batch gives, in float64 on a tiny model."""

import random
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist

from asyncrl.config import load_config
from asyncrl.protocol import schema
from asyncrl.tools.tiny_model import tiny_config
from learners import packing
from learners.batch import build_step, micro_batch
from learners.logprobs import micro_logprobs
from learners.step import batch_targets, policy_update
from tests.helpers import gloo_group

VOCAB = 41


def ragged_groups(num_groups: int, n: int = 4, seed: int = 0, max_comp: int = 12, vocab: int = VOCAB):
    """Groups with prompts of 2-6 tokens and completions of 0-`max_comp` tokens (an empty one included)."""
    rng = random.Random(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for i in range(n):
            k = 0 if (g, i) == (0, 1) else rng.randint(1, max_comp)
            samples.append(schema.Sample(completion_ids=schema.pack_i32([rng.randint(3, vocab - 1) for _ in range(k)]),
                                         logprobs=schema.pack_f32([-rng.uniform(0.5, 4) for _ in range(k)]),
                                         versions=schema.pack_i32([0] * k), reward=float(rng.random() > 0.5)))
        groups.append(schema.TrajectoryGroup(
            schema_version=schema.SCHEMA_VERSION, group_id=f"p{g}@e0", prompt_id=f"p{g}", generator_id="t",
            prompt_ids=schema.pack_i32([rng.randint(3, vocab - 1) for _ in range(rng.randint(2, 6))]),
            samples=samples, sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=0.0))
    return groups


def tiny_lm(seed: int = 0, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    cfg.tie_word_embeddings = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.config.use_cache = False
    return model


def plan_for(step, cfg, world=1, budget=10_000):
    lc = cfg.learner
    return packing.plan_step(step.group_sizes, step.lengths, step.comp_len, world=world, minibatches=lc.minibatches,
                             epochs=lc.ppo_epochs, budget=budget, packed=lc.packing, seed=0)


def one_update(model, groups, cfg, budget, world=1, rank=0):
    """One step through the learner's functions with plain SGD; returns (stats, gradients of the first
    update, the plan)."""
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg, world, budget)
    grads = {}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    orig_step = opt.step

    def capture():
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        orig_step()

    opt.step = capture
    targets = batch_targets(model, step, plan, cfg, rank)
    stats = policy_update(model, opt, step, plan, cfg, targets, rank, world)
    return stats, grads, plan


# ---- the plan ------------------------------------------------------------------------------------

def test_balanced_bins_and_micro_bins_fit_and_balance():
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in np.clip(rng.lognormal(5.7, 0.8, 600), 32, 2048) + rng.integers(100, 300, 600)]
    items = list(range(len(lengths)))
    bins = packing.balanced_bins(lengths, items, 7)
    sums = [sum(lengths[i] for i in b) for b in bins]
    assert sorted(i for b in bins for i in b) == items
    assert max(sums) - min(sums) <= max(lengths), sums
    for world in (1, 2, 4):
        per_rank = packing.micro_bins(lengths, items, world, 16384, packed=True)
        counts = {len(r) for r in per_rank}
        assert len(counts) == 1, "every rank runs the same number of micro-batches"
        flat = [i for r in per_rank for b in r for i in b]
        assert sorted(flat) == items
        assert all(sum(lengths[i] for i in b) <= 16384 for r in per_rank for b in r)
        work = [sum(lengths[i] for b in r for i in b) for r in per_rank]
        assert max(work) / min(work) < 1.02, work
    # Padded: rows x longest within the budget.
    per_rank = packing.micro_bins(lengths, items, 2, 16384, packed=False)
    assert all(len(b) * max(lengths[i] for i in b) <= 16384 for r in per_rank for b in r)


def test_minibatches_are_disjoint_whole_groups_reshuffled_each_epoch():
    sizes = [4] * 12
    lengths = [10 + i for i in range(48)]
    plan = packing.plan_step(sizes, lengths, [5] * 48, world=2, minibatches=3, epochs=2, budget=25, packed=True,
                             seed=7)
    assert plan.num_updates == 6
    layouts = []
    for epoch in plan.epochs:
        seen = []
        for mb in epoch:
            seqs = sorted(s for r in mb.micro for b in r for s in b)
            groups = {s // 4 for s in seqs}
            assert seqs == sorted(s for g in groups for s in range(4 * g, 4 * g + 4)), "a group is never split"
            assert mb.num_seqs == len(seqs) == 16 and mb.num_tokens == 5 * 16
            seen += seqs
            layouts.append(frozenset(groups))
        assert sorted(seen) == list(range(48)), "each sequence once per epoch"
    assert set(layouts[:3]) != set(layouts[3:]), "reshuffled every epoch"
    with pytest.raises(ValueError, match="minibatches=13"):
        packing.plan_step(sizes, lengths, [5] * 48, world=1, minibatches=13, epochs=1, budget=25, packed=True, seed=0)


# ---- the update ----------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_one_micro_batch_equals_many(packed, aggregation):
    """The loss and every gradient of one update are the same over 1 micro-batch as over many."""
    cfg = load_config(None, [f"algorithm.aggregation={aggregation}", f"learner.packing={str(packed).lower()}"])
    groups = ragged_groups(4)
    whole_stats, whole, plan1 = one_update(tiny_lm(), groups, cfg, budget=10_000)
    split_stats, split, plan8 = one_update(tiny_lm(), groups, cfg, budget=40)
    assert plan1.micro_batches(0) == 1 and plan8.micro_batches(0) >= 4
    assert split_stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-6, abs=1e-6)
    for n, g in whole.items():
        assert torch.allclose(split[n], g, rtol=1e-5, atol=1e-7), (n, (split[n] - g).abs().max())
    assert any(g.abs().sum() > 0 for g in whole.values())


def test_packed_equals_padded_logprobs_and_gradients():
    groups = ragged_groups(3, seed=4)
    step = build_step(groups, "cpu")
    seqs = list(range(step.num_seqs))
    out = {}
    for packed in (True, False):
        model = tiny_lm()
        mb = micro_batch(step, seqs, packed, pad_id=0)
        logp = micro_logprobs(model, mb, 0.8)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype)).sum().backward()
        out[packed] = (logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    assert out[True][0].shape == (step.num_tokens,)
    assert torch.allclose(out[True][0], out[False][0], atol=1e-7)
    for n, g in out[False][1].items():
        assert torch.allclose(out[True][1][n], g, atol=1e-7), n


def test_packed_rows_never_attend_across_sequences():
    """A sequence's log-probs in a packed row do not depend on its neighbours."""
    groups = ragged_groups(2, seed=9)
    step = build_step(groups, "cpu")
    model = tiny_lm()
    with torch.no_grad():
        alone = micro_logprobs(model, micro_batch(step, [3], True, 0), 1.0)
        together = micro_logprobs(model, micro_batch(step, [2, 3, 4], True, 0), 1.0)
    n2 = step.comp_len[2]
    assert torch.allclose(together[n2:n2 + step.comp_len[3]], alone, atol=1e-7)


def test_k_minibatches_take_k_optimizer_steps_each_group_once_per_epoch(monkeypatch):
    import learners.step as step_mod

    cfg = load_config(None, ["learner.batch_groups=6", "learner.minibatches=3", "learner.ppo_epochs=2"])
    groups = ragged_groups(6)
    model = tiny_lm()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step = build_step(groups, "cpu")
    plan = plan_for(step, cfg, budget=30)
    targets = batch_targets(model, step, plan, cfg)
    assert targets.prox_N is not None, "several updates: the proximal log-probs are computed ahead"
    trained = []
    real = step_mod.micro_batch
    monkeypatch.setattr(step_mod, "micro_batch", lambda st, seqs, *a: (trained.append(list(seqs)), real(st, seqs, *a))[1])
    stats = policy_update(model, opt, step, plan, cfg, targets, scheduler=sched)
    assert int(opt.state[next(model.parameters())]["step"]) == 6, "3 mini-batches x 2 epochs"
    assert sched.last_epoch == 6, "the schedule counts optimizer steps"
    n0 = sum(len(mb.micro[0]) for mb in plan.epochs[0])
    assert len(trained) == plan.micro_batches(0) and n0 > 3
    for part in (trained[:n0], trained[n0:]):
        assert sorted(s for seqs in part for s in seqs) == list(range(step.num_seqs)), "each sequence once per epoch"
    assert stats["grad_norm"] > 0


def _ws_worker(rank: int, port: int, aggregation: str, q) -> None:
    from torch.distributed.fsdp import fully_shard

    with gloo_group(rank, port, q):
        cfg = load_config(None, [f"algorithm.aggregation={aggregation}"])
        model = tiny_lm(dtype=torch.float64)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        stats, grads, plan = one_update(model, ragged_groups(4, seed=2), cfg, budget=40, world=2, rank=rank)
        full = {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()}
        loss = torch.tensor([stats["loss"]], dtype=torch.float64)
        dist.all_reduce(loss)  # each rank holds its part of the loss
        if rank == 0:
            q.put((float(loss), stats["grad_norm"], {n: g.numpy() for n, g in full.items()}, plan.micro_batches(0)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_world_size_2_equals_world_size_1(aggregation):
    """Two FSDP2 ranks over gloo, each with its share of the sequences in micro-batches, make the
    update one rank makes on the whole batch: loss, gradient norm, every gradient."""
    import torch.multiprocessing as mp

    cfg = load_config(None, [f"algorithm.aggregation={aggregation}"])
    stats1, grads1, _ = one_update(tiny_lm(), ragged_groups(4, seed=2), cfg, budget=10_000)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = mp.start_processes(_ws_worker, args=(_free_port(), aggregation, q), nprocs=2, join=False,
                               start_method="spawn")
    loss2, norm2, grads2, micro2 = q.get(timeout=300)  # before joining: the gradients are a large item
    while not procs.join():
        pass
    assert micro2 > 1
    assert loss2 == pytest.approx(stats1["loss"], rel=1e-6, abs=1e-6)
    assert norm2 == pytest.approx(stats1["grad_norm"], rel=1e-6)
    for n, g in grads1.items():
        assert np.allclose(grads2[n], g.numpy(), rtol=1e-5, atol=1e-7), n


@pytest.mark.slow
def test_learner_runs_minibatches_in_micro_batches_and_the_kl_controller_counts_sequences(tmp_path, tiny_model):
    """A learner process on fixed groups: 2 optimizer steps a step over several micro-batches, the
    step's metrics say so, and the adaptive KL coefficient moves by the step's number of samples
    (16 sequences: 4 groups of 4), not of groups."""
    from tests.test_learner_variants import run_learner

    cfg, rows = run_learner(tmp_path, tiny_model, "mb", ["learner.minibatches=2", "learner.micro_batch_tokens=48",
                                                         "algorithm.kl_coef=0.05", "algorithm.kl_target=0.001",
                                                         "algorithm.kl_horizon=100"], steps=3, groups_per_step=4)
    assert [r["updates"] for r in rows] == [2.0, 2.0, 2.0]
    assert all(r["micro_batches"] > 2 and r["pad_frac"] == 0.0 and r["micro_batch_tokens"] == 48 for r in rows)
    for prev, nxt in zip(rows, rows[1:], strict=False):
        err = max(min(prev["kl"] / 0.001 - 1, 0.2), -0.2)
        assert nxt["kl_coef"] == pytest.approx(prev["kl_coef"] * (1 + err * 16 / 100), rel=1e-6), (prev, nxt)
