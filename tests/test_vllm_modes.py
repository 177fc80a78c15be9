"""Weight-update modes on the CPU build of vLLM with the tiny model, one engine for all three:
keep (in-flight sequences continue under the new weights), abort (resubmitted with their tokens so
far), drain (in-flight finish first). Per-token versions show where the switch happened.

The push streams inside the pause (weights.atomic=false, `asyncrl_receive`): the pause then starts
as soon as the push does, while the samples are surely in flight. With the default staged transfer
the pause waits for the whole transfer, and on a loaded box (CI) every sample had finished by then,
so keep had nothing to continue; test_weight_push_vllm covers the staged path."""

import asyncio

import pytest

from tests.gen_support import Pusher, perturbed_state, switch_points


@pytest.mark.slow
def test_vllm_weight_modes_keep_abort_drain(make_cfg, tmp_path):
    from transformers import AutoTokenizer

    from asyncrl.tools.tiny_model import write_tiny_model
    from generators.vllm_engine import VllmEngine

    # Untrained, so that its completions run on (the end token is one of 128) and some are surely in
    # flight when the update comes: the warm-started model stops after 1-8 tokens, and the update
    # then sometimes found every sample finished.
    model = str(write_tiny_model(tmp_path / "untrained", seed=0))
    max_tokens = 48
    cfg = make_cfg(f"generator.max_tokens={max_tokens}", "generator.max_model_len=96", "weights.atomic=false",
                   f"model.path={model}")
    tok = AutoTokenizer.from_pretrained(model)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("abcd=", "hg=", "fedc=", "bad=")]
    states = [perturbed_state(model, seed) for seed in (1, 2, 3)]
    engine = VllmEngine(cfg, model)
    pusher = Pusher()

    async def in_flight_push(sd, version, mode):
        tasks = [asyncio.create_task(engine.generate_group(p, 4, lambda: 0)) for p in prompts]
        while not any(t.done() for t in tasks) and progress["tokens"] < 8:  # push mid-generation
            await asyncio.sleep(0.005)
        stats = await pusher.push(engine, sd, version, mode)
        return [s for g in await asyncio.gather(*tasks) for s in g], stats

    progress = {"tokens": 0}

    real_stream = engine._stream

    async def counting_stream(prompt_ids, params, version, samples):
        before = sum(len(s.token_ids) for s in samples)
        task = asyncio.create_task(real_stream(prompt_ids, params, version, samples))
        while not task.done():
            progress["tokens"] = max(progress["tokens"], sum(len(s.token_ids) for s in samples) - before)
            await asyncio.sleep(0.002)
        await task

    engine._stream = counting_stream  # only watches progress; generation is vLLM's own

    async def scenario():
        await pusher.join(engine)
        results = {}
        for (mode, version), sd in zip((("keep", 1), ("abort", 2), ("drain", 3)), states, strict=True):
            progress["tokens"] = 0
            results[mode] = await in_flight_push(sd, version, mode)
        return results

    try:
        results = asyncio.run(scenario())
        resubmitted = engine.num_resubmitted
    finally:
        engine.shutdown()
    for mode, (samples, stats) in results.items():
        assert len(samples) == 16 and stats["pause_s"] > 0, mode
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) > 0, mode
            assert len(s.token_ids) <= max_tokens and s.finish_reason in ("stop", "length"), (mode, s.finish_reason)
            assert all(lp <= 0 for lp in s.logprobs)
    keep, _ = results["keep"]
    assert any(p[1:] == (0, 1) for p in switch_points(keep)), "keep: no sample continued across the update"
    abort, _ = results["abort"]
    assert resubmitted > 0, "abort: nothing was aborted and resubmitted"
    assert any(p[1:] == (1, 2) for p in switch_points(abort)), "abort: no resubmitted sample continued"
    drain, drain_stats = results["drain"]
    assert not switch_points(drain) and all(set(s.versions) == {2} for s in drain), "drain: a sample mixes versions"
    assert drain_stats["wait_s"] > 0
