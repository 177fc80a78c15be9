"""The guessing game (`data.task=guess`): a multi-turn game with feedback.

A row is a secret whole number from 1 to `env.guess_max`, drawn from `run.seed` (held out: another
seed). Each assistant turn is a guess (the last integer of the turn); the environment replies
"Higher." or "Lower." as the next user message. Reward 1.0 for the turn that names the number
(the episode ends there), 0.0 when `env.max_turns` guesses did not. A turn without a number is
answered with what a guess looks like and counted as a tool error (a malformed action).
"""

from __future__ import annotations

import random

from asyncrl.envs.base import Environment, StepResult
from asyncrl.tasks.arith import extract_integer
from asyncrl.tasks.base import EVAL_SEED_OFFSET, PromptRecord
from asyncrl.tasks.registry import Task

SYSTEM_PROMPT = "Play a guessing game. Reply to each message with one whole number."


def prompt(guess_max: int, max_turns: int) -> str:
    return (f"I am thinking of a whole number from 1 to {guess_max}. Guess it: reply with one number. "
            f"After each wrong guess I say higher or lower. You have {max_turns} guesses.")


def _rows(num_rows: int, seed: int, cfg) -> list[PromptRecord]:
    rng = random.Random(seed)
    text = prompt(cfg.env.guess_max, cfg.env.max_turns)
    return [PromptRecord(prompt_id=f"guess-{seed}-{i}", prompt=text, answer=str(rng.randint(1, cfg.env.guess_max)))
            for i in range(num_rows)]


def train_rows(cfg) -> list[PromptRecord]:
    return _rows(cfg.data.num_prompts, cfg.run.seed, cfg)


def eval_rows(cfg) -> list[PromptRecord]:
    return _rows(cfg.eval.num_prompts, cfg.run.seed + EVAL_SEED_OFFSET, cfg)


class GuessEnv(Environment):
    system_prompt = SYSTEM_PROMPT

    async def step(self, assistant_text: str) -> StepResult:
        secret, guess = int(self.row.answer), extract_integer(assistant_text)
        if guess is None:
            return StepResult(observation=f"Reply with one whole number from 1 to {self.cfg.env.guess_max}.",
                              tool_errors=1)
        if guess == secret:
            return StepResult(reward=1.0, done=True, tool_calls=1)
        return StepResult(observation="Higher." if guess < secret else "Lower.", tool_calls=1)


TASK = Task("guess", train_rows=train_rows, eval_rows=eval_rows, environment=GuessEnv)
