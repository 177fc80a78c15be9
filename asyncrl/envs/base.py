"""The environment interface of multi-turn episodes.

An environment is made for one episode from one row (`Task.environment(cfg, row)`), and the
generator (generators/episodes.py) drives it:

    first = await env.start()          # the first user message (text), default: the row's prompt
    loop:  assistant turn sampled by the policy
           result = await env.step(assistant_text)   # bounded by env.step_timeout_s
           result.done -> the episode ends with result.reward added
           else result.observation is appended (a user message, or chat messages) and the policy goes on
    env.close()

Rewards are summed over the steps. `step` is a coroutine: a blocking tool runs off the event loop
(`run_blocking`, or a subprocess as the Python sandbox does). An exception or a timeout in `start`
or `step` ends that episode with a recorded reason (`env_error:<Type>`, `env_timeout`), never the
generator. Only the standard library is imported here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.tasks.base import PromptRecord

Message = dict[str, str]  # {"role": ..., "content": ...}


@dataclass
class StepResult:
    """What one environment step returns. `observation`: a user message's text, or chat messages
    (e.g. `[{"role": "tool", "content": "..."}]`) appended after the assistant's turn; unused when
    `done`. `tool_calls` / `tool_errors`: the well-formed and the failed tool calls of this step."""

    observation: str | list[Message] = ""
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """One episode. Subclasses set `system_prompt` (what teaches the model the tool format) and
    implement `step`; `start` returns the first user message (by default the row's prompt).
    `examples`: worked exchanges (each a list of chat messages) placed between the system prompt and the
    first user message, the first `env.examples` of them; a small model takes a tool's format from a
    worked exchange far more readily than from instructions. They are prompt tokens: never in the loss."""

    system_prompt: str = ""
    examples: list[list[Message]] = []

    def __init__(self, cfg: Config, row: PromptRecord):
        self.cfg = cfg
        self.row = row

    async def start(self) -> str:
        return self.row.prompt

    async def step(self, assistant_text: str) -> StepResult:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the episode holds; called once, however the episode ended."""


EnvFactory = Callable[["Config", "PromptRecord"], Environment]


def system_prompt_of(factory: EnvFactory, cfg: Config) -> str:
    """The system prompt an episode starts with: `env.system_prompt` when set, else the environment's
    own (`no_tools_prompt` for a tool environment under `env.tools=false`)."""
    if cfg.env.system_prompt:
        return cfg.env.system_prompt
    if not cfg.env.tools and hasattr(factory, "no_tools_prompt"):
        return factory.no_tools_prompt
    return getattr(factory, "system_prompt", "")


def examples_of(factory: EnvFactory, cfg: Config) -> list[Message]:
    """The messages of the worked exchanges an episode starts with: the first `env.examples` (-1: all)
    of the environment's `examples`, of a tool environment's `no_tools_examples` under `env.tools=false`."""
    if not cfg.env.tools and hasattr(factory, "no_tools_examples"):
        exchanges = factory.no_tools_examples
    else:
        exchanges = getattr(factory, "examples", [])
    chosen = exchanges if cfg.env.examples < 0 else exchanges[: cfg.env.examples]
    return [message for exchange in chosen for message in exchange]


async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """A blocking call (a tool, a file, a computation) on a worker thread: the event loop, which
    runs every other episode of the generator, goes on meanwhile."""
    return await asyncio.to_thread(fn, *args)


def clip_observation(text: str, max_chars: int) -> str:
    """`text` cut to `max_chars`, saying so: a long tool output must not fill the context."""
    if len(text) <= max_chars:
        return text
    return text[:max_chars] + f"... [cut: {len(text) - max_chars} more characters]"
