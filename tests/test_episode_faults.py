"""An environment that raises, hangs or floods ends (or trims) its episode, never the generator; an
episode that spans a weight update carries the versions of both sides."""

import asyncio
import time

import pytest

from asyncrl.envs.base import Environment, StepResult
from asyncrl.tasks.base import PromptRecord
from generators.episodes import EpisodeLimits, TurnCodec, run_episode


class Raises(Environment):
    async def step(self, assistant_text):
        raise RuntimeError("the tool broke")


class Hangs(Environment):
    async def step(self, assistant_text):
        await asyncio.sleep(60)


class Floods(Environment):
    async def step(self, assistant_text):
        return StepResult(observation="x" * 10_000_000)


class Counts(Environment):
    """Answers every turn; `on_step` runs first (here: the generator taking a new version)."""

    on_step = None

    async def step(self, assistant_text):
        if self.on_step:
            self.on_step()
        return StepResult(observation="go on")


@pytest.fixture(scope="module")
def engine_and_codec(tmp_path_factory):
    from transformers import AutoTokenizer

    from asyncrl.config import load_config
    from asyncrl.tools.tiny_model import write_tiny_model
    from generators.hf_engine import HfEngine

    model = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, warm_start_steps=0))
    cfg = load_config(None, [f"model.path={model}", "generator.backend=hf", "generator.max_tokens=6",
                             "generator.max_model_len=96", "env.max_turns=3", "env.step_timeout_s=0.5",
                             "env.max_observation_chars=40"])
    engine = HfEngine(cfg, model)
    yield cfg, engine, TurnCodec(AutoTokenizer.from_pretrained(model), chat_template=False)
    engine.shutdown()


def _play(cfg, engine, codec, env, version=lambda: 0):
    prompt_ids = codec.prompt_ids(env.system_prompt, "copy: a b c")
    return asyncio.run(run_episode(engine, codec, env, prompt_ids, version, EpisodeLimits.from_config(cfg)))


def test_a_raising_or_hanging_environment_ends_its_episode_with_the_reason(engine_and_codec):
    cfg, engine, codec = engine_and_codec
    row = PromptRecord("r", "copy: a b c", "a b c")
    broken = _play(cfg, engine, codec, Raises(cfg, row))
    assert broken.end_reason == "env_error:RuntimeError" and broken.turns == 1 and broken.token_ids
    t0 = time.monotonic()
    stuck = _play(cfg, engine, codec, Hangs(cfg, row))
    assert stuck.end_reason == "env_timeout" and time.monotonic() - t0 < 5
    # The engine goes on serving episodes after both.
    assert _play(cfg, engine, codec, Counts(cfg, row)).end_reason == "max_turns"


def test_a_flooding_observation_is_cut_to_its_limit(engine_and_codec):
    cfg, engine, codec = engine_and_codec
    ep = _play(cfg, engine, codec, Floods(cfg, PromptRecord("r", "copy: a b c", "a b c")))
    observed = [t for t, m in zip(ep.token_ids, ep.mask, strict=True) if not m]
    text = codec.tokenizer.decode(observed)
    assert "more characters]" in text and len(text) < 200, text
    assert len(ep.token_ids) <= cfg.generator.max_model_len


def test_an_episode_that_spans_a_weight_update_carries_both_versions(engine_and_codec):
    cfg, engine, codec = engine_and_codec
    state = {"version": 4}
    env = Counts(cfg, PromptRecord("r", "copy: a b c", "a b c"))
    env.on_step = lambda: state.update(version=state["version"] + 1)  # a push lands between two turns
    ep = _play(cfg, engine, codec, env, version=lambda: state["version"])
    policy_versions = [v for v, m in zip(ep.versions, ep.mask, strict=True) if m]
    assert ep.turns == 3 and sorted(set(policy_versions)) == [4, 5, 6], policy_versions
    assert policy_versions == sorted(policy_versions), "each turn stamped with the weights it was sampled under"
