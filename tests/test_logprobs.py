"""Chunked log-probs against the naive full-logits computation: values and gradients, plain and FSDP2."""

import copy
import socket

import pytest
import torch
import torch.distributed as dist

from asyncrl.algorithms.advantages import grpo as grpo_advantages
from asyncrl.algorithms.losses import decoupled_ppo
from asyncrl.config import Config
from asyncrl.tools.tiny_model import tiny_config
from learners.logprobs import linear_logprobs, sequence_logprobs
from learners.step import policy_update
from tests.helpers import aggregate, gloo_group, token_logprobs


def naive_linear_logprobs(h, w, b, targets, temperature):
    logits = h @ w.t() + (b if b is not None else 0.0)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_logprobs_values_and_grads_match_naive(with_bias, keep):
    torch.manual_seed(0)
    B, T, H, V = 2, 7, 5, 13
    h = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, V, (B, T))
    upstream = torch.randn(B, T, dtype=torch.float64)
    leaves = [t for t in (h, w, b) if t is not None]

    ref = naive_linear_logprobs(h, w, b, targets, 0.7)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), leaves)
    # 14 rows: chunks of 3, 3, 3, 3, 2; keep: the logits buffer is kept for the backward
    out = linear_logprobs(h, w, targets, 0.7, bias_V=b, chunk_rows=3, keep_logits_bytes=1 << 20 if keep else 0)
    grads = torch.autograd.grad((out * upstream.float()).sum(), leaves)

    assert out.dtype == torch.float32 and out.shape == (B, T)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    for g, rg in zip(grads, ref_grads, strict=True):
        assert g.dtype == rg.dtype
        assert torch.allclose(g, rg, atol=1e-5), (g - rg).abs().max()


@pytest.mark.parametrize("keep", [False, True])
def test_linear_logprobs_rows_subset_and_kept_logits(keep):
    """Only the chosen rows are computed (others exactly 0, no gradient through them); keeping the
    logits for the backward gives the same gradients as recomputing them."""
    torch.manual_seed(2)
    B, T, H, V = 3, 6, 5, 11
    h = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    rows = torch.zeros(B, T)
    rows[0, 2:] = 1
    rows[2, 1:4] = 1
    upstream = torch.randn(B, T, dtype=torch.float64)
    ref = naive_linear_logprobs(h, w, None, targets, 0.9) * rows
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (h, w))
    out = linear_logprobs(h, w, targets, 0.9, chunk_rows=2, rows_BT=rows, keep_logits_bytes=1 << 20 if keep else 0)
    grads = torch.autograd.grad((out * upstream.float()).sum(), (h, w))
    assert torch.equal(out[rows == 0], torch.zeros(int((rows == 0).sum())))
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.equal(grads[0][rows == 0], torch.zeros_like(grads[0][rows == 0]))
    for g, rg in zip(grads, ref_grads, strict=True):
        assert torch.allclose(g, rg, atol=1e-5), (g - rg).abs().max()


def test_fusable_logit_grad_equals_eager():
    """The comparison-one-hot form compiled on CUDA computes what the scatter form computes, both
    overwriting the logits in place."""
    from learners.logprobs import _grad_logits_eager, _grad_logits_fusable, _logp_lse_eager

    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        z = torch.randn(9, 50).to(dtype)
        y = torch.randint(0, 50, (9,))
        g = torch.randn(9)
        logp, lse = _logp_lse_eager(z, y)
        assert torch.allclose(logp, torch.log_softmax(z.float(), -1).gather(1, y[:, None]).squeeze(1), atol=1e-6)
        a, b = _grad_logits_eager(z.clone(), lse, y, g), _grad_logits_fusable(z.clone(), lse, y, g)
        assert a.dtype == b.dtype == dtype
        assert torch.allclose(a.float(), b.float(), atol=1e-6 if dtype == torch.float32 else 1e-2)


def test_linear_logprobs_bf16_close_to_fp32():
    torch.manual_seed(1)
    h = torch.randn(3, 40, 32)
    w = torch.randn(500, 32) * 0.2
    targets = torch.randint(0, 500, (3, 40))
    ref = naive_linear_logprobs(h, w, None, targets, 1.0)
    out = linear_logprobs(h.bfloat16(), w.bfloat16(), targets, 1.0, chunk_rows=64)
    assert out.dtype == torch.float32
    assert ((out - ref).norm() / ref.norm()) < 1e-2


def tiny_lm(tied: bool, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(vocab_size=37, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=48)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)
    model.config.use_cache = False
    return model


def padded_batch(vocab=37, B=3, L=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, L), generator=g)
    attn = torch.ones(B, L, dtype=torch.long)
    attn[1, 6:] = 0  # right padding, as build_batch makes it
    ids[1, 6:] = 0
    return ids, attn


def naive_sequence_logprobs(model, ids, attn, temperature):
    logits = model(input_ids=ids, attention_mask=attn).logits
    return token_logprobs(logits[:, :-1], ids[:, 1:], temperature)


@pytest.mark.parametrize("tied", [False, True])
def test_sequence_logprobs_matches_full_logits_and_grads(tied):
    model = tiny_lm(tied)
    ids, attn = padded_batch()
    upstream = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(3))

    ref = naive_sequence_logprobs(model, ids, attn, 0.8)
    (ref * upstream).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    out = sequence_logprobs(model, ids, attn, 0.8, chunk_rows=5)
    (out * upstream).sum().backward()

    assert torch.allclose(out, ref, atol=1e-5)
    if tied:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], atol=1e-5), n


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tied", [False, True])
def test_sequence_logprobs_under_fsdp2_world_size_1(tied):
    """The registered forward method unshards the root's parameters (embedding, norm, head) and the
    head's gradient reaches the sharded parameter, tied or not."""
    from torch.distributed.fsdp import fully_shard

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        plain = tiny_lm(tied)
        sharded = copy.deepcopy(plain)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        ids, attn = padded_batch()
        ref = naive_sequence_logprobs(plain, ids, attn, 1.0)
        ref.sum().backward()
        out = sequence_logprobs(sharded, ids, attn, 1.0, chunk_rows=4)
        out.sum().backward()
        assert torch.allclose(out, ref, atol=1e-5)
        ref_grads = dict(plain.named_parameters())
        for n, p in sharded.named_parameters():
            assert p.grad is not None, n
            assert torch.allclose(p.grad.full_tensor(), ref_grads[n].grad, atol=1e-5), n
        # Only the loss positions, picked by host-made flat indices: the same values there, 0 elsewhere.
        rows = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        rows[0, 2:] = rows[2, 4:7] = 1
        idx = rows.reshape(-1).nonzero().squeeze(1)
        picked = sequence_logprobs(sharded, ids, attn, 1.0, chunk_rows=4, rows_BT=idx)
        assert torch.allclose(picked, ref.detach() * rows, atol=1e-5)
    finally:
        dist.destroy_process_group()


def _clip_worker(rank: int, port: int, q) -> None:
    from torch.distributed.fsdp import fully_shard

    from learners.step import clip_grad_norm

    with gloo_group(rank, port, q):
        plain = tiny_lm(tied=True)
        sharded = copy.deepcopy(plain)
        for layer in sharded.model.layers:
            fully_shard(layer)
        fully_shard(sharded)
        ids, attn = padded_batch()
        for m in (plain, sharded):
            (sequence_logprobs(m, ids, attn, 1.0) * attn[:, 1:]).sum().neg().backward()
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        got = clip_grad_norm(sharded.parameters(), 0.05)
        full = {n: p.grad.full_tensor() for n, p in sharded.named_parameters()}
        if rank == 0:
            ref = dict(plain.named_parameters())
            q.put((float(want), float(got), max(float((g - ref[n].grad).abs().max()) for n, g in full.items())))


def test_clip_grad_norm_on_fsdp2_shards_matches_torch():
    """Two gloo ranks: the local-shard norm (one all-reduce) equals torch's clip_grad_norm_ on the
    unsharded model, and the clipped gradients match."""
    import torch.multiprocessing as mp

    from learners.step import clip_grad_norm

    plain, twin = tiny_lm(tied=False), tiny_lm(tied=False)
    ids, attn = padded_batch()
    for m in (plain, twin):
        sequence_logprobs(m, ids, attn, 1.0).sum().backward()
    assert abs(float(clip_grad_norm(plain.parameters(), 0.05)) -
               float(torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05))) < 1e-5
    for a, b in zip(plain.parameters(), twin.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, atol=1e-7)

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    mp.start_processes(_clip_worker, args=(_free_port(), q), nprocs=2, join=True, start_method="spawn")
    want, got, max_diff = q.get(timeout=10)
    assert want > 0.05, "the test must actually clip"
    assert abs(want - got) < 1e-5 * max(1.0, want) and max_diff < 1e-6, (want, got, max_diff)


def test_policy_update_equals_the_full_logits_update():
    """The plain full-logits step on the padded batch (token_logprobs, one update) and `policy_update`
    over packed micro-batches move the parameters to the same place."""
    from learners.batch import build_batch, build_step
    from learners.packing import plan_step
    from learners.step import batch_targets
    from tests.test_microbatch import ragged_groups

    cfg = Config()
    cfg.generator.temperature = 0.9
    groups = ragged_groups(2, n=3, seed=1, vocab=37)
    model = tiny_lm(tied=False)
    old = copy.deepcopy(model)
    step = build_step(groups, "cpu")
    plan = plan_step(step.group_sizes, step.lengths, step.comp_len, world=1, minibatches=1, epochs=1, budget=30,
                     packed=True, seed=0)
    assert plan.micro_batches(0) > 1
    # SGD: the update is linear in the gradient, so equal updates mean equal gradients.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = policy_update(model, opt, step, plan, cfg, batch_targets(model, step, plan, cfg))

    B = build_batch(groups, pad_id=0, device="cpu")
    opt_old = torch.optim.SGD(old.parameters(), lr=0.1)
    logp = naive_sequence_logprobs(old, B.input_ids_BL, B.attention_mask_BL, 0.9)
    a = cfg.algorithm
    adv_B = grpo_advantages(B.rewards_B.view(-1, 3)).reshape(-1)
    loss_BT, ls = decoupled_ppo(logp, logp.detach(), B.behav_logp_BT, adv_B[:, None] * B.loss_mask_BT,
                                B.loss_mask_BT, a.clip_low, a.clip_high, a.is_cap)
    loss = aggregate(loss_BT, B.loss_mask_BT, a.aggregation)
    w = torch.exp(logp.detach() - B.behav_logp_BT)[B.loss_mask_BT.bool()]
    ess = float(w.sum() ** 2 / (w.numel() * (w**2).sum()))
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(old.parameters(), cfg.learner.max_grad_norm)
    opt_old.step()

    assert abs(stats["loss"] - float(loss.detach())) < 1e-6 and abs(stats["grad_norm"] - float(grad_norm)) < 1e-5
    assert stats["ess"] == pytest.approx(ess, rel=1e-5)
    assert stats["is_weight_max"] == pytest.approx(float(w.max()), rel=1e-5)
    for (n, p), q in zip(model.named_parameters(), old.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-6), n
    assert not torch.allclose(model.lm_head.weight, tiny_lm(tied=False).lm_head.weight)  # it did move
