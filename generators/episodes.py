"""Multi-turn episodes: the policy's turns and the environment's observations, token-exact.

One episode is one sample of a group (docs/agentic.md). Its tokens after the prompt are kept as
sampled, turn after turn (the conversation is never re-tokenised), with the observation tokens the
chat template puts between two assistant turns appended in between. Every token carries a loss-mask
bit (1: sampled by the policy; 0: an observation, or an end-of-turn token the template needs and the
turn did not sample), its behaviour log-prob (0.0 where the mask is 0) and the policy version it was
sampled under (an episode may span weight updates: each turn is stamped as it streams in).

What ends an episode, recorded as its `end_reason`: the environment says `done`; `max_turns`
(env.max_turns assistant turns); `max_tokens` (env.max_tokens, or the model length, reached; a
turn cut off by generator.max_tokens alone is still a turn: the environment answers it);
`env_timeout` (a step
took longer than env.step_timeout_s); `env_error:<Type>` (the environment raised). The generator
never fails because of its environment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.envs.base import Environment, Message, clip_observation, examples_of, system_prompt_of
from asyncrl.tasks.base import PromptRecord

log = logging.getLogger(__name__)

_MARK = "\x00asyncrl-turn\x00"  # stands in for an assistant turn when the template's framing is measured


class TurnCodec:
    """Token ids of a conversation's parts: the prompt (system prompt and first user message) and each
    observation, through the tokenizer's chat template (with `data.chat_template` and a template),
    else as plain text (the system prompt, the user message and each observation on lines of their own)."""

    def __init__(self, tokenizer, chat_template: bool):
        self.tokenizer = tokenizer
        self.chat = bool(chat_template and getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.turn_end_id = tokenizer.eos_token_id if not isinstance(eos, list) else eos[0]

    def _template(self, messages: list[Message], generation_prompt: bool):
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, system_prompt: str, user: str, examples: list[Message] = ()) -> list[int]:
        """The system prompt, the demonstration turns (`examples`, chat messages) and the first user message."""
        if self.chat:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                       [*examples, {"role": "user", "content": user}]
            return self._encode(self._template(messages, True))
        lines = [system_prompt] if system_prompt else []
        return self._encode("\n".join([*lines, *(m["content"] for m in examples), user]) + "\n")

    def observation_ids(self, observation: str | list[Message]) -> list[int]:
        """The tokens that follow an assistant turn ended by its end-of-turn token: the template's
        framing of the observation messages and the next assistant turn's header. Measured as the
        difference between the template of a conversation with the observation and one without it,
        cut right after the assistant turn's end-of-turn token (which the turn itself sampled)."""
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
        if not self.chat:
            return self._encode("\n" + "\n".join(m["content"] for m in messages) + "\n")
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _MARK}]
        without = self._template(base, False)
        cut = without.rindex(_MARK) + len(_MARK)
        eos = self.tokenizer.eos_token or ""
        if eos and without.startswith(eos, cut):
            cut += len(eos)
        with_obs = self._template(base + messages, True)
        if not with_obs.startswith(without[:cut]):
            raise ValueError("the chat template renders earlier turns differently once an observation follows; "
                             "multi-turn episodes need a template that only appends")
        return self._encode(with_obs[cut:])


@dataclass
class EpisodeLimits:
    max_turns: int
    max_tokens: int  # after the prompt, turns and observations
    turn_tokens: int  # generator.max_tokens: one assistant turn
    max_model_len: int
    step_timeout_s: float
    max_observation_chars: int

    @classmethod
    def from_config(cls, cfg) -> EpisodeLimits:
        g, e = cfg.generator, cfg.env
        return cls(max_turns=e.max_turns, max_tokens=e.max_tokens or g.max_model_len, turn_tokens=g.max_tokens,
                   max_model_len=g.max_model_len, step_timeout_s=e.step_timeout_s,
                   max_observation_chars=e.max_observation_chars)


@dataclass
class EpisodeOut:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = ""  # the last turn's (stop, length)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    end_reason: str = ""

    def add(self, ids: list[int], logprobs: list[float], versions: list[int], policy: bool) -> None:
        self.token_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.mask += [int(policy)] * len(ids)

    def add_other(self, ids: list[int]) -> None:
        """Tokens the policy did not sample: mask 0, log-prob 0.0, the version of the turn before."""
        self.add(ids, [0.0] * len(ids), [self.versions[-1]] * len(ids), policy=False)


def episode_start(gen, task) -> tuple[PromptRecord, list[int]]:
    """What an episode of a leased prompt or eval task starts from: the row its environment is made from,
    and the prompt's token ids (the environment's system prompt, unless env.system_prompt replaces it, and
    its demonstration turns)."""
    row = PromptRecord(prompt_id=task.prompt_id, prompt=task.prompt, answer=task.answer)
    return row, gen.codec.prompt_ids(system_prompt_of(gen.env_factory, gen.cfg), task.prompt,
                                     examples_of(gen.env_factory, gen.cfg))


async def run_episode(engine, codec: TurnCodec, env: Environment, prompt_ids: list[int], version: Callable[[], int],
                      limits: EpisodeLimits, temperature: float | None = None) -> EpisodeOut:
    """Plays one episode to its end; never raises because of the environment (see the module doc).
    `temperature`: None, generator.temperature; 0.0, greedy turns (evaluation)."""
    ep = EpisodeOut()
    try:
        await _play(engine, codec, env, prompt_ids, version, limits, ep, temperature)
    finally:
        try:
            env.close()
        except Exception as e:  # noqa: BLE001 - an environment's cleanup must not fail its episode
            log.warning("environment close raised %r", e)
    return ep


async def _play(engine, codec, env, prompt_ids, version, limits, ep: EpisodeOut, temperature: float | None) -> None:
    while True:
        room = min(limits.max_tokens - len(ep.token_ids), limits.max_model_len - len(prompt_ids) - len(ep.token_ids))
        budget = min(limits.turn_tokens, room)
        if budget <= 0:
            ep.end_reason = "max_tokens"
            return
        (turn,) = await engine.generate_group(prompt_ids + ep.token_ids, 1, version, temperature=temperature,
                                              max_tokens=budget)
        ep.turns += 1
        ep.finish_reason = turn.finish_reason
        ep.add(turn.token_ids, turn.logprobs, turn.versions, policy=True)
        if not turn.token_ids or (turn.finish_reason != "stop" and budget < limits.turn_tokens):
            ep.end_reason = "max_tokens"  # the episode's budget, not the turn's, cut it off
            return
        text = codec.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        t0 = time.monotonic()
        try:
            result = await asyncio.wait_for(env.step(text), timeout=limits.step_timeout_s)
        except TimeoutError:
            ep.end_reason = "env_timeout"
            return
        except Exception as e:  # noqa: BLE001 - the episode ends with the reason; the generator goes on
            log.warning("environment step raised %r; the episode ends there", e)
            ep.end_reason = f"env_error:{type(e).__name__}"
            return
        finally:
            ep.env_s += time.monotonic() - t0
        ep.reward += float(result.reward)
        ep.tool_calls += result.tool_calls
        ep.tool_errors += result.tool_errors
        if result.done:
            ep.end_reason = "done"
            return
        if ep.turns >= limits.max_turns:
            ep.end_reason = "max_turns"
            return
        observation = result.observation
        if isinstance(observation, str):
            observation = clip_observation(observation, limits.max_observation_chars)
        else:
            observation = [{**m, "content": clip_observation(m["content"], limits.max_observation_chars)}
                           for m in observation]
        # A turn that ended without its end-of-turn token (another stop condition, or generator.max_tokens)
        # gets it from the template's side, outside the loss.
        closing = [] if turn.token_ids[-1] in codec.eos_ids else [codec.turn_end_id]
        obs_ids = closing + codec.observation_ids(observation)
        if len(ep.token_ids) + len(obs_ids) >= min(limits.max_tokens, limits.max_model_len - len(prompt_ids)):
            ep.end_reason = "max_tokens"
            return
        ep.add_other(obs_ids)
