"""The calculator task (`data.task=calc`): multiplications a small model cannot do in its head, with a
calculator tool, played as multi-turn episodes.

A row is `A * B` with operands of `env.calc_digits` digits (`3x2`: 347 * 86), drawn from `run.seed`;
one problem in ten (a fixed hash) is held out. The system prompt teaches the tool: the model writes
`<calculator>347*86</calculator>` (or the chat template's `<tool_call>` JSON, asyncrl/envs/tools.py),
the environment answers `<result>29842</result>` as the next user message, and the model goes on. A
turn without a tool call is the final answer: reward 1.0 when its integer (the last `\\boxed{}` or the
last number, as the arith task reads it) is the product, else 0.0; the episode ends there. A malformed
call is answered with `<error>...</error>` and counted as a tool error. Two worked exchanges (a call,
its result, the boxed answer) open each episode (`env.examples` of them); with `env.tools=false` the
same problems answered directly, and no calculator.

The calculator evaluates + - * / // % and parentheses on integers and decimals (no names, no
calls, no powers), on a worker thread: `ast.parse` of the expression, walked node by node.
"""

from __future__ import annotations

import ast
import operator
import random
import zlib

from asyncrl.envs.base import StepResult, run_blocking
from asyncrl.envs.tools import ToolCall, ToolEnvironment
from asyncrl.tasks.arith import arith_reward, operand_range
from asyncrl.tasks.base import EVAL_SEED_OFFSET, PromptRecord
from asyncrl.tasks.registry import Task

TOOLS = {"calculator": "expression"}
SYSTEM_PROMPT = ("You can use a calculator. To use it, write <calculator>EXPRESSION</calculator> and stop; "
                 "the result comes back as <result>VALUE</result>. When you know the answer, write it as "
                 "\\boxed{NUMBER}.")
NO_TOOLS_PROMPT = "Write the answer as \\boxed{NUMBER}."  # env.tools=false: the same answer format, no tool


def exchange(a: int, b: int, tool: bool) -> list[dict[str, str]]:
    """A worked exchange: the question, the call and its result (with the tool), the boxed answer."""
    ask = {"role": "user", "content": f"What is {a} * {b}?"}
    answer = {"role": "assistant", "content": f"\\boxed{{{a * b}}}"}
    if not tool:
        return [ask, answer]
    return [ask, {"role": "assistant", "content": f"<calculator>{a}*{b}</calculator>"},
            {"role": "user", "content": f"<result>{a * b}</result>"}, answer]


# Two worked exchanges open each episode (env.examples): SmolLM2-135M-Instruct calls the calculator in
# 19 of 24 sampled first turns with both, 3 of 24 with the first, none of 24 from the system prompt alone.
EXAMPLES = [exchange(12, 34, tool=True), exchange(531, 27, tool=True)]
NO_TOOLS_EXAMPLES = [exchange(12, 34, tool=False), exchange(531, 27, tool=False)]
MAX_EXPRESSION_CHARS = 200
HELD_OUT_EVERY = 10

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError (one line) for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("×", "*").replace("^", "**"), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r} as arithmetic") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            try:
                return _OPS[type(node.op)](walk(node.left), walk(node.right))
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError(f"only numbers, + - * / // % and parentheses are allowed, not {type(node).__name__}")

    value = walk(tree)
    return int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value


def parse_digits(spec: str) -> tuple[int, int]:
    a, sep, b = spec.lower().partition("x")
    if not (sep and a.isdigit() and b.isdigit() and 1 <= int(a) <= 9 and 1 <= int(b) <= 9):
        raise ValueError(f"env.calc_digits={spec!r} must be AxB with digit counts 1-9, e.g. 3x2")
    return int(a), int(b)


def problems(num_rows: int, seed: int, digits: tuple[int, int], held_out: bool) -> list[tuple[int, int]]:
    rng, out = random.Random(seed), []
    for _ in range(100 * num_rows):
        a, b = rng.randint(*operand_range(digits[0])), rng.randint(*operand_range(digits[1]))
        if (zlib.crc32(f"{a}*{b}".encode()) % HELD_OUT_EVERY == 0) == held_out:
            out.append((a, b))
            if len(out) == num_rows:
                break
    return out


def _rows(num_rows: int, seed: int, cfg, held_out: bool) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"calc-{seed}-{i}", prompt=f"What is {a} * {b}?", answer=str(a * b))
            for i, (a, b) in enumerate(problems(num_rows, seed, parse_digits(cfg.env.calc_digits), held_out))]


def train_rows(cfg) -> list[PromptRecord]:
    return _rows(cfg.data.num_prompts, cfg.run.seed, cfg, held_out=False)


def eval_rows(cfg) -> list[PromptRecord]:
    return _rows(cfg.eval.num_prompts, cfg.run.seed + EVAL_SEED_OFFSET, cfg, held_out=True)


class CalculatorEnv(ToolEnvironment):
    system_prompt = SYSTEM_PROMPT
    no_tools_prompt = NO_TOOLS_PROMPT
    examples = EXAMPLES
    no_tools_examples = NO_TOOLS_EXAMPLES
    tools = TOOLS

    def final_reward(self, assistant_text: str) -> float:
        return arith_reward(assistant_text, self.row.answer)

    async def call_tool(self, call: ToolCall) -> StepResult:
        try:
            value = await run_blocking(evaluate, call.argument)
        except ValueError as e:
            return StepResult(observation=f"<error>{e}</error>", tool_calls=1, tool_errors=1)
        return StepResult(observation=f"<result>{value}</result>", tool_calls=1)


def check(cfg) -> list[str]:
    try:
        parse_digits(cfg.env.calc_digits)
    except ValueError as e:
        return [str(e)]
    return []


TASK = Task("calc", train_rows=train_rows, eval_rows=eval_rows, check=check, environment=CalculatorEnv)
