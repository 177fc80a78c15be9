"""A multi-turn episode with a real chat model: its tokens are the chat template's rendering of the
conversation, and its loss mask covers exactly what the policy sampled."""

import asyncio

import pytest

from asyncrl.config import load_config
from asyncrl.envs.guess import GuessEnv, prompt
from asyncrl.tasks.base import PromptRecord
from generators.episodes import EpisodeLimits, TurnCodec, run_episode
from tests.test_smollm2 import smollm2  # noqa: F401 - the converted SmolLM2 folder (a session fixture)

SECRET = "731"  # out of any guess a few sampled turns make: the episode runs its three turns


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(bit, start, end) of each run of equal mask bits."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_the_prompt_with_demonstration_turns_is_the_templates_rendering(smollm2):  # noqa: F811
    from transformers import AutoTokenizer

    from asyncrl.envs import calc

    tok = AutoTokenizer.from_pretrained(smollm2)
    shots = calc.EXAMPLES[0] + calc.EXAMPLES[1]
    ids = TurnCodec(tok, chat_template=True).prompt_ids(calc.SYSTEM_PROMPT, "What is 347 * 86?", shots)
    messages = [{"role": "system", "content": calc.SYSTEM_PROMPT}, *shots, {"role": "user", "content": "What is 347 * 86?"}]
    assert tok.decode(ids) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    no_tool = calc.NO_TOOLS_EXAMPLES[0] + calc.NO_TOOLS_EXAMPLES[1]
    plain = tok.decode(TurnCodec(tok, chat_template=False).prompt_ids("S", "Q", no_tool))
    assert plain == "S\nWhat is 12 * 34?\n\\boxed{408}\nWhat is 531 * 27?\n\\boxed{14337}\nQ\n"


def test_a_three_turn_episode_is_the_chat_templates_rendering_with_only_the_assistant_in_the_mask(smollm2):  # noqa: F811
    from transformers import AutoTokenizer

    from generators.hf_engine import HfEngine

    cfg = load_config(None, [f"model.path={smollm2}", "generator.backend=hf", "generator.max_tokens=12",
                             "generator.max_model_len=512", "data.chat_template=true",
                             "env.max_turns=3", "env.guess_max=1000", "run.seed=3"])
    tok = AutoTokenizer.from_pretrained(smollm2)
    engine = HfEngine(cfg, smollm2)
    codec = TurnCodec(tok, chat_template=True)
    row = PromptRecord(prompt_id="g", prompt=prompt(1000, 3), answer=SECRET)
    env = GuessEnv(cfg, row)
    prompt_ids = codec.prompt_ids(env.system_prompt, row.prompt)
    try:
        ep = asyncio.run(run_episode(engine, codec, env, prompt_ids, lambda: 7, EpisodeLimits.from_config(cfg)))
    finally:
        engine.shutdown()
    assert (ep.turns, ep.end_reason) == (3, "max_turns"), (ep.turns, ep.end_reason)
    assert len(ep.token_ids) == len(ep.mask) == len(ep.logprobs) == len(ep.versions)
    assert set(ep.versions) == {7}

    # The policy's runs are the three turns; the environment's replies, through the template, between them.
    runs = _segments(ep.mask)
    assert [bit for bit, _, _ in runs] == [1, 0, 1, 0, 1], runs
    turns = [ep.token_ids[a:b] for bit, a, b in runs if bit]
    texts = [tok.decode(t, skip_special_tokens=True) for t in turns]
    replies = [asyncio.run(GuessEnv(cfg, row).step(t)).observation for t in texts[:2]]
    assert all(r in ("Higher.", "Lower.") or r.startswith("Reply with one whole number") for r in replies)
    messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": row.prompt}]
    for i, text in enumerate(texts):
        messages.append({"role": "assistant", "content": text})
        if i < 2:
            messages.append({"role": "user", "content": replies[i]})
    rendered = tok.apply_chat_template(messages, tokenize=False)
    got = tok.decode(prompt_ids + ep.token_ids, skip_special_tokens=False)
    assert rendered.startswith(got), (got, rendered)
    # Only the last turn's closing (its end-of-turn token if it was cut off, and the newline) is left.
    assert rendered[len(got):] in ("\n", tok.eos_token + "\n"), rendered[len(got):]

    # Sampled tokens carry their behaviour log-probs; the template's tokens none.
    for bit, a, b in runs:
        lps = ep.logprobs[a:b]
        assert all(lp == 0.0 for lp in lps) if not bit else all(lp < 0.0 or lp == pytest.approx(0.0) for lp in lps)
    assert any(lp < 0.0 for bit, a, b in runs if bit for lp in ep.logprobs[a:b])
