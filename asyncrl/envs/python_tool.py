"""GSM8K with a Python tool (`data.task=gsm8k_python`), played as multi-turn episodes.

Rows: the GSM8K task's (`data.path`, asyncrl/tasks/gsm8k.py). The system prompt teaches the tool:
the model writes `<python>CODE</python>` (or the chat template's `<tool_call>` JSON with a `code`
argument), the program runs in the sandbox (asyncrl/envs/sandbox.py: a fresh process with CPU-time,
memory and output limits, a wall-clock timeout, no network, a throw-away working directory and a
scrubbed environment; the `env.sandbox_*` keys) and what it printed comes back as
`<output>...</output>`; a failed run (an exception, a limit hit) comes back as `<error>...</error>`
and counts as a tool error. A turn without a tool call is the final answer, scored by the GSM8K
reward (`\\boxed{}` or the last number, compared as a number); the episode ends there.
"""

from __future__ import annotations

from asyncrl.envs.base import StepResult
from asyncrl.envs.sandbox import SandboxLimits, SandboxResult, run_python
from asyncrl.envs.tools import ToolCall, ToolEnvironment
from asyncrl.tasks import prompts
from asyncrl.tasks.math_reward import gsm8k_reward
from asyncrl.tasks.registry import Task

TOOLS = {"python": "code"}
SYSTEM_PROMPT = ("You can run Python. To run a program, write <python>CODE</python> and stop; what it prints "
                 "comes back as <output>TEXT</output>. Use print() to see values. When you know the answer, "
                 "write it as \\boxed{NUMBER}.")


def observation(result: SandboxResult) -> tuple[str, bool]:
    """(what the model sees of a run, whether the run failed)."""
    if result.timed_out:
        return "<error>the program did not finish in time</error>", True
    if result.output_cut:
        return f"<error>the program printed too much; its output began: {result.stdout[:200]}</error>", True
    if result.exit_code != 0:
        lines = result.stderr.strip().splitlines()
        reason = lines[-1] if lines else f"exit code {result.exit_code} (a limit was hit)"
        return f"<error>{reason}</error>", True
    return f"<output>{result.stdout.strip()}</output>", False


class PythonToolEnv(ToolEnvironment):
    system_prompt = SYSTEM_PROMPT
    no_tools_prompt = "Solve the problem step by step and write the final answer as \\boxed{NUMBER}."
    tools = TOOLS

    def final_reward(self, assistant_text: str) -> float:
        return gsm8k_reward(assistant_text, self.row.answer)

    async def call_tool(self, call: ToolCall) -> StepResult:
        result = await run_python(call.argument, SandboxLimits.from_config(self.cfg.env))
        text, failed = observation(result)
        return StepResult(observation=text, tool_calls=1, tool_errors=int(failed),
                          info={"sandbox_s": result.seconds})


def check(cfg) -> list[str]:
    errors = prompts.check(cfg)
    if cfg.env.sandbox_timeout_s >= cfg.env.step_timeout_s:
        errors.append(f"env.sandbox_timeout_s={cfg.env.sandbox_timeout_s} must be below env.step_timeout_s="
                      f"{cfg.env.step_timeout_s}: a run the sandbox would end must not end the episode first")
    return errors


TASK = Task("gsm8k_python", train_rows=prompts.train_rows, eval_rows=prompts.eval_rows, check=check,
            environment=PythonToolEnv)
