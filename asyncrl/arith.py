"""The arithmetic task (`data.task=arith`): integer problems with an exact-integer reward.

A problem is `a OP b` with OP drawn from `data.arith_ops` (`+`, `-`, `*`) and each operand a number
of `data.arith_min_digits`..`data.arith_max_digits` digits (one digit: 0-9; n digits: 10^(n-1) to
10^n - 1; with `data.arith_nonnegative` a subtraction never goes below zero), asked through `data.arith_prompt` (by default "What is 47 + 38? Answer with the number
only."; with `data.chat_template=true` it goes through the model's chat template). Training prompts
are drawn from `run.seed`; the held-out evaluation set from another seed, without the training
problems where the problem space leaves enough others.

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

from asyncrl.math_reward import extract_boxed
from asyncrl.tasks import PromptRecord

log = logging.getLogger(__name__)

OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
DEFAULT_PROMPT = "What is {a} {op} {b}? Answer with the number only."
EVAL_SEED_OFFSET = 104_729  # the held-out set's seed is run.seed + this (the copy task uses the same)

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


def arith_problems(num_rows: int, seed: int, ops: str = "+-", min_digits: int = 2, max_digits: int = 2,
                   nonnegative: bool = False,
                   exclude: set[tuple[int, str, int]] | None = None) -> list[tuple[int, str, int]]:
    """`num_rows` problems (a, op, b) drawn from `seed`; `nonnegative` swaps the operands of a
    subtraction whose result would be negative. Those in `exclude` are skipped while the problem
    space has others (a bounded number of redraws, then they are allowed, with a warning)."""
    rng = random.Random(seed)
    exclude = exclude or set()
    problems, redraws = [], 0
    while len(problems) < num_rows:
        op = rng.choice(ops)
        a = rng.randint(*operand_range(rng.randint(min_digits, max_digits)))
        b = rng.randint(*operand_range(rng.randint(min_digits, max_digits)))
        if nonnegative and op == "-" and a < b:
            a, b = b, a
        if (a, op, b) in exclude and redraws < 20 * num_rows:
            redraws += 1
            continue
        problems.append((a, op, b))
    if redraws >= 20 * num_rows:
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
    """The training prompts: `data.num_prompts` problems from `run.seed`."""
    problems = arith_problems(cfg.data.num_prompts, cfg.run.seed, **_settings(cfg.data))
    return arith_records(problems, cfg.run.seed, cfg.data.arith_prompt)


def eval_set(cfg) -> list[PromptRecord]:
    """The held-out prompts: `eval.num_prompts` problems from another seed, none of the training ones."""
    seed = cfg.run.seed + EVAL_SEED_OFFSET
    train = set(arith_problems(cfg.data.num_prompts, cfg.run.seed, **_settings(cfg.data)))
    problems = arith_problems(cfg.eval.num_prompts, seed, exclude=train, **_settings(cfg.data))
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
