"""The arithmetic task (`data.task=arith`): integer problems with an exact-integer reward.

A problem is `a OP b` with OP drawn from `data.arith_ops` (`+`, `-`, `*`) and each operand a number
of `data.arith_min_digits`..`data.arith_max_digits` digits (one digit: 0-9; n digits: 10^(n-1) to
10^n - 1; with `data.arith_nonnegative` a subtraction never goes below zero), asked through `data.arith_prompt` (by default "What is 47 + 38? Answer with the number
only."; with `data.chat_template=true` it goes through the model's chat template).

Held out: one problem in `HELD_OUT_EVERY`, picked by a fixed hash of the problem, belongs to the
evaluation side. Training prompts are drawn from `run.seed` among the others, the held-out set from
another seed among those, by the same draw: both sets follow one distribution (the mix of operand
digit counts and operations), and no held-out problem is trained on. (Excluding whatever the training
draw happened to hit instead would empty the small one-digit corner of the space first and leave a
held-out set harder than the training mix.)

The reward (`reward.name=arith`) is 1.0 when the answer is exactly the integer, else 0.0. The answer
is the last integer inside the last `\\boxed{...}` when there is one, else the last number of the
completion. A number with a non-zero fractional part is not an integer ("3.5" is wrong, "12.0" is
12); thousands separators are allowed ("1,234"); a minus sign counts only where it cannot be a
subtraction ("10-3" ends in 3, "= -3" in -3).
"""

from __future__ import annotations

import logging
import random
import re
import zlib

from asyncrl.tasks.base import PromptRecord
from asyncrl.tasks.math_reward import extract_boxed
from asyncrl.tasks.registry import Task

log = logging.getLogger(__name__)

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
DEFAULT_PROMPT = "What is {a} {op} {b}? Answer with the number only."
EVAL_SEED_OFFSET = 104_729  # the held-out set's seed is run.seed + this (the copy task uses the same)
HELD_OUT_EVERY = 10  # one problem in ten belongs to the held-out side

# A number not preceded by a digit, a letter or a point, so "10-3" yields 3, not -3, and "x2" nothing.
_NUMBER = re.compile(r"(?<![\w.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")


def operand_range(digits: int) -> tuple[int, int]:
    return (0, 9) if digits == 1 else (10 ** (digits - 1), 10 ** digits - 1)


def check_settings(ops: str, min_digits: int, max_digits: int, prompt: str) -> list[str]:
    """Config errors for the `data.arith_*` settings (empty when they are fine)."""
    errors = []
    if not ops or any(op not in OPS for op in ops):
        errors.append(f"data.arith_ops={ops!r} must be one or more of {''.join(OPS)!r}, e.g. '+-'")
    if not 1 <= min_digits <= max_digits <= 9:
        errors.append(f"data.arith_min_digits ({min_digits}) and data.arith_max_digits ({max_digits}) must satisfy "
                      "1 <= min <= max <= 9")
    try:
        prompt.format(a=1, op="+", b=2)
    except (KeyError, IndexError, ValueError) as e:
        errors.append(f"data.arith_prompt={prompt!r} must use only the fields {{a}}, {{op}} and {{b}} ({e!r})")
    return errors


def is_held_out(problem: tuple[int, str, int]) -> bool:
    """Whether a problem belongs to the held-out side: a fixed hash, the same on every machine."""
    a, op, b = problem
    return zlib.crc32(f"{a}{op}{b}".encode()) % HELD_OUT_EVERY == 0


def arith_problems(num_rows: int, seed: int, ops: str = "+-", min_digits: int = 2, max_digits: int = 2,
                   nonnegative: bool = False, side: str | None = None) -> list[tuple[int, str, int]]:
    """`num_rows` problems (a, op, b) drawn from `seed`; `nonnegative` swaps the operands of a
    subtraction whose result would be negative. `side` ("train" or "eval") keeps only the problems of
    that side of the hold-out (a draw of the other side is drawn again, a bounded number of times;
    past it, as in a problem space too small to have both sides, it is allowed, with a warning)."""
    if side not in (None, "train", "eval"):
        raise ValueError(f"side={side!r} must be 'train', 'eval' or None")
    rng = random.Random(seed)
    problems, redraws, limit = [], 0, 50 * num_rows
    while len(problems) < num_rows:
        op = rng.choice(ops)
        a = rng.randint(*operand_range(rng.randint(min_digits, max_digits)))
        b = rng.randint(*operand_range(rng.randint(min_digits, max_digits)))
        if nonnegative and op == "-" and a < b:
            a, b = b, a
        if side is not None and is_held_out((a, op, b)) != (side == "eval") and redraws < limit:
            redraws += 1
            continue
        problems.append((a, op, b))
    if redraws >= limit:
        log.warning("the arithmetic problem space (ops=%s, digits %d-%d) is too small to keep the held-out set "
                    "apart from the training set: some held-out problems are also trained on", ops,
                    min_digits, max_digits)
    return problems


def arith_records(problems: list[tuple[int, str, int]], seed: int,
                  prompt: str = DEFAULT_PROMPT) -> list[PromptRecord]:
    return [PromptRecord(prompt_id=f"arith-{seed}-{i}", prompt=prompt.format(a=a, op=op, b=b),
                         answer=str(OPS[op](a, b)))
            for i, (a, op, b) in enumerate(problems)]


def _settings(data_cfg) -> dict:
    return {"ops": data_cfg.arith_ops, "min_digits": data_cfg.arith_min_digits,
            "max_digits": data_cfg.arith_max_digits, "nonnegative": data_cfg.arith_nonnegative}


def train_set(cfg) -> list[PromptRecord]:
    """The training prompts: `data.num_prompts` problems from `run.seed`, none of the held-out side."""
    problems = arith_problems(cfg.data.num_prompts, cfg.run.seed, side="train", **_settings(cfg.data))
    return arith_records(problems, cfg.run.seed, cfg.data.arith_prompt)


def eval_set(cfg) -> list[PromptRecord]:
    """The held-out prompts: `eval.num_prompts` problems of the held-out side, from another seed, drawn
    as the training ones are (one distribution)."""
    seed = cfg.run.seed + EVAL_SEED_OFFSET
    problems = arith_problems(cfg.eval.num_prompts, seed, side="eval", **_settings(cfg.data))
    return arith_records(problems, seed, cfg.data.arith_prompt)


# ---- reward ------------------------------------------------------------------------------------


def extract_integer(completion: str) -> int | None:
    """The completion's answer as an integer, or None (no number, or one with a fractional part)."""
    boxed = extract_boxed(completion)
    text = boxed if boxed is not None else completion
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    sign, digits, fraction = matches[-1]
    if fraction and int(fraction) != 0:
        return None
    return int(sign + digits.replace(",", ""))


def arith_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's answer is exactly the integer `answer`, else 0.0."""
    found = extract_integer(completion)
    return float(found is not None and found == int(answer))


def check(cfg) -> list[str]:
    """Config errors of the arithmetic task: its `data.arith_*` settings, and a reward that can score it."""
    d = cfg.data
    errors = check_settings(d.arith_ops, d.arith_min_digits, d.arith_max_digits, d.arith_prompt)
    if cfg.reward.name == "copy" and not (cfg.reward.function or cfg.reward.model):
        errors.append("data.task=arith is scored by reward.name=arith (the copy reward compares letters): set "
                      "reward.name=arith")
    return errors


TASK = Task("arith", train_rows=train_set, eval_rows=eval_set, reward=arith_reward, check=check)
