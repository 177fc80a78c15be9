"""The GSM8K task (`data.task=gsm8k`): grade-school math word problems with a numeric final answer.

Rows: the file task's (asyncrl/tasks/prompts.py), from the parquet `asyncrl data gsm8k` writes
(`train.parquet`; held out: `test.parquet` beside it, or `eval.path`). Reward: the final answer
compared as a number (`reward.name=gsm8k` or `math`; extraction and format bonus under `reward.*`,
asyncrl/tasks/math_reward.py). Preparing the files: asyncrl/tasks/data.py, docs/gsm8k.md.
"""

from __future__ import annotations

from asyncrl.tasks import prompts
from asyncrl.tasks.math_reward import gsm8k_reward
from asyncrl.tasks.registry import Task

TASK = Task("gsm8k", train_rows=prompts.train_rows, eval_rows=prompts.eval_rows, reward=gsm8k_reward,
            check=prompts.check)
