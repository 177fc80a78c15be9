"""After a weight push over the project's gloo group, vLLM (CPU build) generates greedily exactly
what the learner's own Hugging Face model generates with the same weights, token for token."""

import asyncio
import time

import pytest
import torch

from asyncrl import schema
from asyncrl.weight_sync import WeightSender, pack_buckets, plan_buckets

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


@pytest.mark.slow
def test_vllm_matches_hf_greedy_after_push(make_cfg, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from generators.vllm_engine import VllmEngine

    cfg = make_cfg("generator.max_tokens=12")
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

    async def scenario():
        before = await _vllm_greedy(engine, tok, PROMPTS, 12)
        loop = asyncio.get_running_loop()
        frames = {}
        opened = loop.run_in_executor(None, sender.open_epoch, ["gtest.0"],
                                      lambda info: frames.setdefault("epoch", schema.encode(info)),
                                      lambda *a, **k: None)
        while "epoch" not in frames:
            await asyncio.sleep(0.01)
        assert await engine.join(frames["epoch"], "gtest", 60)
        assert await opened == ["gtest.0"]
        buckets = plan_buckets([(n, t.dtype, tuple(t.shape)) for n, t in sd.items()], 256 * 1024)
        ann = schema.WeightAnnouncement(schema_version=schema.SCHEMA_VERSION, version=1, epoch=sender.epoch,
                                        buckets=buckets, announced_at=time.time())
        sent = loop.run_in_executor(None, sender.broadcast, buckets,
                                    pack_buckets(buckets, iter(sd.items()), torch.device("cpu")))
        stats = await engine.update_weights(schema.encode(ann), "keep", 60)
        assert stats["checksums"] == await sent
        after = await _vllm_greedy(engine, tok, PROMPTS, 12)
        return before, after

    try:
        before, after = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert before != want, "the perturbation should change greedy output, or the test proves nothing"
    assert after == want
