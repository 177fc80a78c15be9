"""Periodic evaluation, the parts every role shares: Redis names, the held-out set, round maths.

Protocol (all under `asyncrl:{run}:`):
- learner rank 0, every `eval.every` steps (and at the last step), XADDs one `EvalTask` per held-out
  prompt to `eval_prompts`, tagged with its version (`round_id = v{version}`);
- generators lease them (consumer group `generators`) before training prompts, wait until they
  hold that version, generate one greedy sample (temperature 0) and `eval.k` samples at the training
  temperature, and XADD an `EvalResult` to `eval_results`; no trajectory is produced, so training
  data is untouched;
- rank 0 reads `eval_results`, and once a round has every prompt writes `eval/pass@1` (greedy),
  `eval/mean@k`, `eval/pass@k` and `eval/version` (for episodes also the greedy episodes' turns and
  tool calls) into the step's metrics row and `eval.jsonl`, and the greedy answers of the first
  `eval.show` prompts (their tasks are marked `show`; the results carry `greedy_text`) into
  `eval_samples.jsonl`, one row per question per round, which `asyncrl report` reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncrl.protocol import schema
from asyncrl.tasks.base import PromptRecord
from asyncrl.tasks.data import load_dataset_from_config
from asyncrl.tasks.prompts import eval_set_path
from asyncrl.tasks.registry import get_task

EVAL_GROUP = "generators"  # consumer group on the eval_prompts stream


def eval_prompts_key(run: str) -> str:
    return f"asyncrl:{run}:eval_prompts"


def eval_results_key(run: str) -> str:
    return f"asyncrl:{run}:eval_results"


def load_eval_set(cfg) -> list[PromptRecord]:
    """The first `eval.num_prompts` held-out rows: those of `eval.path` when it is set, else the task's
    own (asyncrl/tasks/registry.py; the copy and arith tasks draw theirs from another seed)."""
    task = get_task(cfg.data.task)
    if cfg.eval.path or task.eval_rows is None:
        return load_dataset_from_config(cfg.data, path=eval_set_path(cfg), limit=cfg.eval.num_prompts)
    return task.eval_rows(cfg)[: cfg.eval.num_prompts]


def round_id(version: int) -> str:
    return f"v{version}"


def make_tasks(rows: list[PromptRecord], version: int, k: int, now: float, show: int = 0) -> list[schema.EvalTask]:
    """One task per row; the first `show` ask for their greedy answer's text back (`eval.show`)."""
    return [schema.EvalTask(schema_version=schema.SCHEMA_VERSION, round_id=round_id(version), version=version,
                            prompt_id=r.prompt_id, prompt=r.prompt, answer=r.answer, k=k, released_at=now,
                            show=i < show)
            for i, r in enumerate(rows)]


@dataclass
class Round:
    """Results of one round as they arrive; deduplicated by prompt (a reclaimed task may finish twice)."""

    version: int
    num_prompts: int
    published_at: float
    results: dict[str, schema.EvalResult] = field(default_factory=dict)

    def add(self, result: schema.EvalResult) -> None:
        self.results.setdefault(result.prompt_id, result)

    @property
    def complete(self) -> bool:
        return len(self.results) >= self.num_prompts


def summarize(results: list[schema.EvalResult], k: int) -> dict[str, float]:
    """pass@1 is greedy accuracy; mean@k the mean accuracy of k samples; pass@k: any of the k correct."""
    assert results, "a round with no results has nothing to summarize"
    greedy = np.array([r.greedy_correct for r in results], dtype=np.float64)
    out = {"eval/pass@1": float(greedy.mean()),
           "eval/greedy_reward": float(np.mean([r.greedy_reward for r in results])),
           "eval/num_prompts": len(results), "eval/k": k,
           "eval/min_version": min(r.min_version for r in results),
           "eval/tokens": sum(r.num_tokens for r in results)}
    if any(r.greedy_turns for r in results):  # episodes: how the greedy policy used its turns and tools
        out["eval/turns_mean"] = float(np.mean([r.greedy_turns for r in results]))
        out["eval/tool_calls_mean"] = float(np.mean([r.greedy_tool_calls for r in results]))
        out["eval/tool_call_frac"] = float(np.mean([r.greedy_tool_calls > 0 for r in results]))
    if k > 0:
        correct = np.stack([schema.unpack_i32(r.sample_correct).astype(np.float64) for r in results])
        rewards = np.stack([schema.unpack_f32(r.sample_rewards).astype(np.float64) for r in results])
        out["eval/mean@k"] = float(correct.mean())
        out["eval/pass@k"] = float(correct.max(axis=1).mean())
        out["eval/sample_reward"] = float(rewards.mean())
    return out
