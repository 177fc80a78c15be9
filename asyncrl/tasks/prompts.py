"""The `prompts` task (`data.task=prompts`): any parquet/jsonl/json file of prompts and answers.

Training rows: every row of `data.path` (columns `data.prompt_key`, `data.answer_key`, `data.id_key`;
`data.max_prompt_chars` skips longer prompts). Held out: the first `eval.num_prompts` rows of
`eval.path`, or of the test split beside `data.path` (`train` -> `test` in the file name). No reward
of its own: `reward.name`, `reward.function` or `reward.model` scores it.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.tasks.base import PromptRecord
from asyncrl.tasks.data import load_dataset_from_config
from asyncrl.tasks.registry import Task


def eval_set_path(cfg) -> str:
    """`eval.path`, or the test split beside `data.path` (train.parquet -> test.parquet)."""
    if cfg.eval.path:
        return cfg.eval.path
    path = Path(cfg.data.path)
    if "train" not in path.name:
        raise ValueError(f"eval.path is empty and data.path={cfg.data.path!r} has no 'train' in its name to "
                         "turn into the test split: set eval.path to the held-out file")
    return str(path.with_name(path.name.replace("train", "test")))


def train_rows(cfg) -> list[PromptRecord]:
    return load_dataset_from_config(cfg.data)


def eval_rows(cfg) -> list[PromptRecord]:
    return load_dataset_from_config(cfg.data, path=eval_set_path(cfg), limit=cfg.eval.num_prompts)


def check(cfg) -> list[str]:
    """A file task needs its file."""
    if cfg.data.path:
        return []
    return [f"data.path must name a parquet/jsonl file for data.task={cfg.data.task} (e.g. run `asyncrl data gsm8k "
            "--src openai/gsm8k --out data/gsm8k`, then data.path=data/gsm8k/train.parquet)"]


TASK = Task("prompts", train_rows=train_rows, eval_rows=eval_rows, check=check)
