"""Tool calls parsed from an assistant turn's text.

Two formats are read, the first call of a turn is run:
- the chat template's tool format (Hermes / Qwen2.5, which templates with tools render):
  `<tool_call>{"name": "calculator", "arguments": {"expression": "347*86"}}</tool_call>`;
- a plain tag named after the tool, which an environment's system prompt teaches a model without
  one: `<calculator>347*86</calculator>`.

A call that cannot be read (an unclosed tag, JSON that does not parse, a tool that does not exist,
no argument) is a `ToolCallError`: the environment answers it with an error observation the policy
can learn from, and counts it as a tool error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from asyncrl.envs.base import Environment, StepResult


@dataclass(frozen=True)
class ToolCall:
    name: str
    argument: str  # the tool's one argument (an expression, a program)


@dataclass(frozen=True)
class ToolCallError:
    message: str  # what was wrong and how a call is written, for the error observation


_JSON_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def usage(tools: dict[str, str]) -> str:
    return " or ".join(f"<{name}>{arg.upper()}</{name}>" for name, arg in tools.items())


def parse_tool_call(text: str, tools: dict[str, str]) -> ToolCall | ToolCallError | None:
    """The first tool call of `text`, an error for a malformed one, None when the turn has none.
    `tools` maps each tool's name to the name of its one argument (`{"calculator": "expression"}`)."""
    json_call = _JSON_CALL.search(text)
    tag_calls = [(m.start(), name) for name in tools if (m := re.search(f"<{re.escape(name)}>", text))]
    if json_call and (not tag_calls or json_call.start() < min(tag_calls)[0]):
        return _parse_json(json_call.group(1), bool(json_call.group(2)), tools)
    if not tag_calls:
        return None
    start, name = min(tag_calls)
    body_start = start + len(name) + 2
    end = text.find(f"</{name}>", body_start)
    if end < 0:
        return ToolCallError(f"the <{name}> tag is not closed; write {usage(tools)}")
    argument = text[body_start:end].strip()
    if not argument:
        return ToolCallError(f"<{name}></{name}> is empty; write {usage(tools)}")
    return ToolCall(name, argument)


def _parse_json(body: str, closed: bool, tools: dict[str, str]) -> ToolCall | ToolCallError:
    if not closed:
        return ToolCallError("the <tool_call> tag is not closed")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCallError(f"the tool call is not valid JSON ({e.msg})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCallError('a tool call is {"name": ..., "arguments": {...}}')
    name = call["name"]
    if name not in tools:
        return ToolCallError(f"no tool named {name!r}; the tools are {', '.join(tools)}")
    args = call.get("arguments", {})
    if isinstance(args, str):  # some templates serialise the arguments once more
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {tools[name]: args}
    value = args.get(tools[name]) if isinstance(args, dict) else None
    if not isinstance(value, str) or not value.strip():
        return ToolCallError(f"{name} takes one argument, {tools[name]!r}, a non-empty string")
    return ToolCall(name, value.strip())


class ToolEnvironment(Environment):
    """An environment whose turns call tools until one answers: a turn with a call gets the tool's
    observation (`call_tool`), a call that cannot be read gets an error observation and counts as a
    tool error, and a turn without a call is the final answer, scored by `final_reward`; the episode
    ends there. `tools`: each tool's name and the name of its one argument. With `env.tools=false` no
    tool is offered (`no_tools_prompt`) and the first turn is the final answer."""

    tools: dict[str, str] = {}
    no_tools_prompt: str = ""  # the system prompt with `env.tools=false`: the answer format alone
    no_tools_examples: list = []  # the worked exchanges with `env.tools=false`: answers without a call

    def final_reward(self, assistant_text: str) -> float:
        raise NotImplementedError

    async def call_tool(self, call: ToolCall) -> StepResult:
        raise NotImplementedError

    async def step(self, assistant_text: str) -> StepResult:
        if not self.cfg.env.tools:
            return StepResult(reward=self.final_reward(assistant_text), done=True)
        call = parse_tool_call(assistant_text, self.tools)
        if call is None:
            return StepResult(reward=self.final_reward(assistant_text), done=True)
        if isinstance(call, ToolCallError):
            return StepResult(observation=f"<error>{call.message}</error>", tool_errors=1)
        return await self.call_tool(call)
