"""The copy task, a synthetic task with a verifiable reward (the prompt records are in asyncrl/tasks/base.py).

The `copy` task: the prompt is a short string of letters followed by `=`, the correct completion is
the same letters. The reward is the per-position match rate, with length mismatch counted against
it, so a random policy scores near 0 and a perfect one scores 1. It is learnable by a tiny model on
two CPU cores, which makes it the project's smoke test for "RL actually moves the reward".
Training rows: `data.num_prompts` strings drawn from `run.seed` (`data.alphabet`, `data.min_len` to
`data.max_len` letters); held out: `eval.num_prompts` more, from another seed.
"""

from __future__ import annotations

import random

from asyncrl.tasks.base import EVAL_SEED_OFFSET, PromptRecord
from asyncrl.tasks.registry import Task


def copy_prompt(letters: str) -> str:
    return f"{letters}="


def copy_reward(completion: str, answer: str) -> float:
    """Fraction of answer positions reproduced, divided by the longer of the two lengths."""
    completion = completion.strip()
    if not answer:
        return 0.0
    matches = sum(1 for a, b in zip(completion, answer, strict=False) if a == b)
    return matches / max(len(answer), len(completion))


def copy_dataset(num_rows: int, seed: int, alphabet: str = "abcdefgh", min_len: int = 2,
                 max_len: int = 4) -> list[PromptRecord]:
    rng = random.Random(seed)
    rows = []
    for i in range(num_rows):
        length = rng.randint(min_len, max_len)
        letters = "".join(rng.choice(alphabet) for _ in range(length))
        rows.append(PromptRecord(prompt_id=f"copy-{seed}-{i}", prompt=copy_prompt(letters), answer=letters))
    return rows


# ---- the copy task (data.task=copy) ---------------------------------------------------------------


def _train_rows(cfg) -> list[PromptRecord]:
    d = cfg.data
    return copy_dataset(d.num_prompts, seed=cfg.run.seed, alphabet=d.alphabet, min_len=d.min_len, max_len=d.max_len)


def _eval_rows(cfg) -> list[PromptRecord]:
    d = cfg.data
    return copy_dataset(cfg.eval.num_prompts, seed=cfg.run.seed + EVAL_SEED_OFFSET, alphabet=d.alphabet,
                        min_len=d.min_len, max_len=d.max_len)


def _check(cfg) -> list[str]:
    d = cfg.data
    errors = [] if d.alphabet else ["data.alphabet must hold at least one letter"]
    if d.min_len > d.max_len:
        errors.append("data.min_len must be <= data.max_len")
    return errors


TASK = Task("copy", train_rows=_train_rows, eval_rows=_eval_rows, reward=copy_reward, check=_check)
