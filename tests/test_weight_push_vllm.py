"""After a weight push over the project's gloo group, vLLM (CPU build) generates greedily exactly
what the learner's own Hugging Face model generates with the same weights, token for token."""

import asyncio
import multiprocessing as mp
import time

import pytest
import torch

from asyncrl.protocol import schema
from asyncrl.protocol.weight_sync import WeightSender, pack_buckets, plan_buckets

PROMPTS = ["abc=", "hgfe=", "da=", "bbcd=", "x y z", "7+8="]


def _hf_greedy(model, tok, prompts, max_tokens):
    outs = []
    for p in prompts:
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        outs.append(gen[0, ids.shape[1]:].tolist())
    return outs


async def _vllm_greedy(engine, tok, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        final = None
        async for out in engine.engine.generate(TokensPrompt(prompt_token_ids=tok(p, add_special_tokens=False)["input_ids"]),
                                                sp, request_id=f"greedy-{i}-{time.time()}"):
            final = out
        outs.append(list(final.outputs[0].token_ids))
    return outs


async def join_group(engine, sender, gid: str = "gtest") -> None:
    """Opens the sender's next epoch with the engine's one worker as its member and joins it."""
    loop = asyncio.get_running_loop()
    frames = {}
    opened = loop.run_in_executor(None, sender.open_epoch, [f"{gid}.0"],
                                  lambda info: frames.setdefault("epoch", schema.encode(info)), lambda *a, **k: None)
    while "epoch" not in frames:
        await asyncio.sleep(0.01)
    assert await engine.join(frames["epoch"], gid, 60)
    assert await opened == [f"{gid}.0"]


def _dying_sender(epochs, go):
    """A learner process that opens an epoch, sends one bucket of garbage-free random weights of a
    bigger layout, then dies like kill -9."""
    import os

    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=60)
    sender.open_epoch(["gtest.0"], lambda info: epochs.put(schema.encode(info)), lambda *a, **k: None)
    tensors = {f"model.layers.0.mlp.down_proj.weight.{i}": torch.randn(128, 256) for i in range(4)}
    buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 128 * 1024)
    ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=2, epoch=sender.epoch,
                                    buckets=buckets, announced_at=time.time())
    go.put(schema.encode(ann))
    it = pack_buckets(buckets, iter(tensors.items()), torch.device("cpu"))
    from asyncrl.protocol.transports.collective import start_broadcast as _start_broadcast
    from asyncrl.protocol.transports.collective import wait_work as _wait

    _wait(_start_broadcast(sender.pg, next(it), 60), 60)
    os._exit(9)


@pytest.mark.slow
def test_vllm_matches_hf_greedy_after_push(make_cfg, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generators.vllm_engine import VllmEngine

    cfg = make_cfg("generator.max_tokens=12", "generator.dtype=float32")  # fp32: log-probs compared exactly below
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # The learner's side: the same model after an update (here a random perturbation of every weight).
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    want = _hf_greedy(model, tok, PROMPTS, 12)
    sd = model.state_dict()
    sender = WeightSender("127.0.0.1", 0, "gloo", join_timeout_s=60, sync_timeout_s=60)
    engine = VllmEngine(cfg, tiny_model)
    # One worker on the CPU build: it runs inside the engine core, the one process the engine started.
    import psutil

    started = [p for p in psutil.Process().children(recursive=True)
               if p.pid not in engine._children_before and "resource_tracker" not in " ".join(p.cmdline())]
    assert [p.name() for p in started] == ["VLLM::EngineCore"], [(p.name(), p.cmdline()[:3]) for p in started]

    async def scenario():
        before = await _vllm_greedy(engine, tok, PROMPTS, 12)
        await join_group(engine, sender)
        loop = asyncio.get_running_loop()
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], 256 * 1024)
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=1, epoch=sender.epoch,
                                        buckets=buckets, announced_at=time.time())
        sent = loop.run_in_executor(None, sender.broadcast, buckets,
                                    pack_buckets(buckets, iter(sd.items()), torch.device("cpu")))
        stats = await engine.update_weights(schema.encode(ann), "keep", 60)
        assert stats["checksums"] == await sent
        after = await _vllm_greedy(engine, tok, PROMPTS, 12)
        # Behaviour log-probs as the generator records them (engine.generate_group), under the pushed weights.
        prompt = tok(PROMPTS[0], add_special_tokens=False)["input_ids"]
        sampled = await engine.generate_group(prompt, 4, lambda: 1)

        # Staged (gloo, atomic): the transfer runs while the engine generates. The learner starts its
        # broadcast 2.5 s after the announcement; groups keep completing meanwhile, and generation stands
        # still only for the load.
        done_at, stop = [], asyncio.Event()

        async def keep_generating():
            while not stop.is_set():
                await engine.generate_group(prompt, 2, lambda: 1)
                done_at.append(time.monotonic())

        background = asyncio.create_task(keep_generating())
        await asyncio.sleep(0.5)

        def late_broadcast():
            time.sleep(2.5)
            return sender.broadcast(buckets, pack_buckets(buckets, iter(sd.items()), torch.device("cpu")))

        ann2 = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=2, epoch=sender.epoch,
                                         buckets=buckets, announced_at=time.time())
        t_announce = time.monotonic()
        sent2 = loop.run_in_executor(None, late_broadcast)
        staged_stats = await engine.update_weights(schema.encode(ann2), "keep", 60)
        t_loaded = time.monotonic()
        stop.set()
        await background
        assert staged_stats["checksums"] == await sent2
        assert staged_stats["stage_s"] >= 2.3, staged_stats
        assert staged_stats["pause_s"] < 0.5 * staged_stats["stage_s"], staged_stats
        during = [t for t in done_at if t_announce + 0.2 < t < t_loaded - staged_stats["pause_s"]]
        assert len(during) >= 2, ("no group completed while the weights were in transfer", done_at, staged_stats)

        # A learner that dies after the first bucket of the next push: the receive fails, nothing is
        # loaded (weights.atomic), and the engine keeps serving the weights it had, unharmed.
        ctx = mp.get_context("spawn")
        epochs, go = ctx.Queue(), ctx.Queue()
        dying = ctx.Process(target=_dying_sender, args=(epochs, go))
        dying.start()
        frame = await loop.run_in_executor(None, epochs.get, True, 120)
        assert await engine.join(frame, "gtest", 60)
        ann_frame = await loop.run_in_executor(None, go.get, True, 120)
        with pytest.raises(RuntimeError, match="weight receive failed"):
            await engine.update_weights(ann_frame, "keep", 20)
        after_failure = await _vllm_greedy(engine, tok, PROMPTS, 12)
        dying.join(timeout=30)
        return before, after, after_failure, prompt, sampled

    try:
        before, after, after_failure, prompt, sampled = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert before != want, "the perturbation should change greedy output, or the test proves nothing"
    assert after == want
    assert after_failure == want, "a failed push must leave the engine on its previous weights"
    # Each sampled token's behaviour log-prob is the pushed model's log-softmax (at the sampling
    # temperature) of that very token: a misaligned or mis-copied log-prob would not match.
    for s in sampled:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) > 0 and set(s.versions) == {1}
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1: -1].float() / cfg.generator.temperature
        want_lp = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.logprobs), want_lp, atol=2e-3), (s.logprobs, want_lp.tolist())
