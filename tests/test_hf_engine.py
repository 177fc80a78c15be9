"""The Hugging Face backend (generator.backend=hf): processed behaviour log-probs, per-token versions,
weight receive over the real gloo weight group in keep / abort / drain, same interface as vLLM's."""

import asyncio

import pytest
import torch

from generators.backends import build_engine
from generators.hf_engine import HfEngine, filter_logits
from tests.gen_support import Pusher, perturbed_state, switch_points


def test_filter_logits_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, 2, 1.0)).tolist() == [[False, False, True, True]]
    # top_p=0.7: 0.5 alone is short of 0.7, 0.5+0.3 crosses it -> the first two are kept
    assert torch.isinf(filter_logits(logits, -1, 0.7)).tolist() == [[False, False, True, True]]
    assert not torch.isinf(filter_logits(logits, -1, 1.0)).any()


def _hf_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_hf_backend_sampling_and_weight_modes(make_cfg, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = make_cfg("generator.backend=hf", "generator.max_tokens=24", "generator.temperature=0.8")
    engine = build_engine(cfg)
    assert isinstance(engine, HfEngine) and engine.num_workers == 1
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = tok("abcd=", add_special_tokens=False)["input_ids"]
    sd1, sd2, sd3 = (perturbed_state(tiny_model, seed) for seed in (1, 2, 3))
    pusher = Pusher()

    async def in_flight_push(sd, version, mode):
        """Starts 3 groups, pushes once they have a few tokens, returns the finished groups."""
        start = engine.num_steps
        tasks = [asyncio.create_task(engine.generate_group(prompt, 4, lambda: 0)) for _ in range(3)]
        while engine.num_steps < start + 6:
            await asyncio.sleep(0.001)
        stats = await pusher.push(engine, sd, version, mode)
        return await asyncio.gather(*tasks), stats

    async def scenario():
        out = await engine.generate_group(prompt, 4, lambda: 0)
        await pusher.join(engine)
        keep = await in_flight_push(sd1, 1, "keep")
        abort = await in_flight_push(sd2, 2, "abort")
        resubmitted = engine.num_resubmitted
        drain = await in_flight_push(sd3, 3, "drain")
        return out, keep, abort, resubmitted, drain

    out, (keep, keep_stats), (abort, _), resubmitted, (drain, drain_stats) = asyncio.run(scenario())
    engine.shutdown()
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for s in out:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) > 0 and set(s.versions) == {0}
        assert s.finish_reason in ("stop", "length")
        want = _hf_logprobs(base, prompt, s.token_ids, 0.8)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-4)
    # keep: in-flight sequences finish under the new weights; versions show where the switch happened
    keep_samples = [s for g in keep for s in g]
    assert any(p[1:] == (0, 1) for p in switch_points(keep_samples)), switch_points(keep_samples)
    assert keep_stats["pause_s"] > 0
    # abort: partial sequences are re-prefilled under the new weights and continue; both parts kept
    abort_samples = [s for g in abort for s in g]
    assert any(p[1:] == (1, 2) for p in switch_points(abort_samples)) and resubmitted > 0
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new_model.load_state_dict(sd2)
    for s in abort_samples:  # tokens after the switch have the new model's log-probs
        cut = s.versions.index(2) if 2 in s.versions else len(s.versions)
        if cut < len(s.versions):
            want = _hf_logprobs(new_model, prompt + s.token_ids[:cut], s.token_ids[cut:], 0.8)
            assert torch.allclose(torch.tensor(s.logprobs[cut:]), want, atol=1e-4)
    # drain: the update waits for the in-flight groups: no sample mixes versions
    drain_samples = [s for g in drain for s in g]
    assert not switch_points(drain_samples) and all(set(s.versions) == {2} for s in drain_samples)
    assert drain_stats["wait_s"] > 0
    assert all(len(s.token_ids) <= 24 for s in keep_samples + abort_samples + drain_samples)


@pytest.mark.parametrize("backend", ["hf"])
def test_engine_interface_matches_vllm(backend):
    import inspect

    from generators.vllm_engine import VllmEngine

    for name in ("generate_group", "join", "update_weights", "idle", "shutdown"):
        assert inspect.signature(getattr(HfEngine, name)) == inspect.signature(getattr(VllmEngine, name)), name
