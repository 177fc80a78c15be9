"""Learner rank 0's side of periodic evaluation: publish rounds, aggregate results, log them.

Called once per step from `Learner.after_step`; returns the `eval/*` metrics of the round that
finished since the last step (empty otherwise), which go into that step's metrics row. Every
finished round is also appended to `{run_dir}/eval.jsonl`, and the greedy answers of its first
`eval.show` prompts to `{run_dir}/eval_samples.jsonl`. At the last step it waits (up to
`eval.timeout_s`) for the rounds still out, so the final model is always evaluated.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from asyncrl.protocol import schema
from asyncrl.tasks.evaluation import (
    EVAL_GROUP,
    Round,
    eval_prompts_key,
    eval_results_key,
    load_eval_set,
    make_tasks,
    round_id,
    summarize,
)

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(self, cfg, client: redis.Redis, start_version: int = 0):
        self.cfg = cfg
        self.enabled = cfg.eval.every > 0
        if not self.enabled:
            return
        self.client = client
        self.prompts_key = eval_prompts_key(cfg.run.name)
        self.results_key = eval_results_key(cfg.run.name)
        self.rows = load_eval_set(cfg)  # a missing held-out file fails here, at start
        self.rounds: dict[str, Round] = {}
        self.published: set[int] = set()
        self.last_id = b"0-0"
        self.path = cfg.run_dir / "eval.jsonl"
        self.samples_path = cfg.run_dir / "eval_samples.jsonl"
        if start_version == 0:
            self._set_aside_earlier_rounds()
        try:
            client.xgroup_create(self.prompts_key, EVAL_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        log.info("evaluation every %d steps on %d held-out prompts (k=%d)", cfg.eval.every, len(self.rows),
                 cfg.eval.k)
        if cfg.eval.before_train and start_version == 0:  # not for a learner resumed from a checkpoint
            self.publish(0)  # the starting model's figure, the first point of every curve

    def publish(self, version: int) -> None:
        if version in self.published:
            return
        self.published.add(version)
        now = time.time()
        pipe = self.client.pipeline(transaction=True)
        for task in make_tasks(self.rows, version, self.cfg.eval.k, now, show=self.cfg.eval.show):
            pipe.xadd(self.prompts_key, {"data": schema.encode(task)}, maxlen=100_000, approximate=True)
        pipe.execute()
        self.rounds[round_id(version)] = Round(version=version, num_prompts=len(self.rows), published_at=now)
        log.info("eval round %s published (%d prompts)", round_id(version), len(self.rows))

    def collect(self, block_ms: int | None = None) -> None:
        reply = self.client.xread({self.results_key: self.last_id}, count=1000, block=block_ms)
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                try:
                    result = schema.decode(fields[b"data"], schema.EvalResult)
                except (schema.FrameError, KeyError) as e:
                    log.error("bad eval result %s dropped: %s", entry_id, e)
                    continue
                if (rnd := self.rounds.get(result.round_id)) is not None:
                    rnd.add(result)

    def finish(self, step: int) -> list[dict]:
        """Pops finished (or timed-out) rounds; returns their metrics rows, oldest first."""
        rows = []
        now = time.time()
        for rid, rnd in sorted(self.rounds.items(), key=lambda kv: kv[1].version):
            timed_out = now - rnd.published_at > self.cfg.eval.timeout_s
            if not (rnd.complete or timed_out):
                continue
            del self.rounds[rid]
            if timed_out and not rnd.complete:
                log.warning("eval round %s timed out with %d/%d results; dropped", rid, len(rnd.results),
                            rnd.num_prompts)
                self._append({"step": step, "eval/version": rnd.version, "eval/incomplete": True,
                               "eval/num_results": len(rnd.results)})
                continue
            row = {"step": step, "eval/version": rnd.version, **summarize(list(rnd.results.values()), self.cfg.eval.k),
                   "eval/seconds": max(r.finished_at for r in rnd.results.values()) - rnd.published_at,
                   # Wall clock when the evaluated weights were current: the x of an accuracy-over-time curve.
                   "eval/published_at": rnd.published_at}
            self._append(row)
            self._keep_answers(step, rnd)
            rows.append(row)
            print(f"eval version={rnd.version} pass@1={row['eval/pass@1']:.3f} "
                  f"mean@{self.cfg.eval.k}={row.get('eval/mean@k', float('nan')):.3f} "
                  f"prompts={row['eval/num_prompts']} seconds={row['eval/seconds']:.1f}", flush=True)
        return rows

    def _append(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def _keep_answers(self, step: int, rnd: Round) -> None:
        """One row per shown question of a finished round, in held-out order: the question, the
        reference answer and the greedy answer with its score. One write, so a reader sees whole rows."""
        lines = []
        for index, prompt in enumerate(self.rows[: self.cfg.eval.show]):
            result = rnd.results.get(prompt.prompt_id)
            if result is None or result.greedy_text is None:  # a generator of code before `show`
                continue
            lines.append(json.dumps({
                "step": step, "version": rnd.version, "published_at": rnd.published_at,
                "finished_at": result.finished_at, "index": index, "prompt_id": prompt.prompt_id,
                "prompt": prompt.prompt, "answer": prompt.answer, "completion": result.greedy_text,
                "reward": result.greedy_reward, "correct": result.greedy_correct,
                "turns": result.greedy_turns, "tool_calls": result.greedy_tool_calls}) + "\n")
        if lines:
            with open(self.samples_path, "a") as f:
                f.write("".join(lines))

    def _set_aside_earlier_rounds(self) -> None:
        """A learner starting at version 0 starts the run's evaluation afresh: rounds an earlier run of
        this name left in the run folder are kept aside (`eval.{stamp}.jsonl`), not mixed into this run's."""
        stamp = int(time.time())
        for path in (self.path, self.samples_path):
            if path.exists():
                path.rename(path.with_name(f"{path.stem}.{stamp}{path.suffix}"))
                log.info("%s of an earlier run kept aside as %s.%d%s", path.name, path.stem, stamp, path.suffix)

    def after_step(self, step: int, version: int) -> dict:
        if not self.enabled:
            return {}
        last = step >= self.cfg.run.max_steps
        if step % self.cfg.eval.every == 0 or last:
            # The newest version the generators hold: weights go out every weights.sync_every versions.
            self.publish(version - version % self.cfg.weights.sync_every)
        self.collect()
        rows = self.finish(step)
        # The final model is evaluated before the run ends: wait for what is still out.
        while last and self.rounds:
            self.collect(block_ms=500)
            rows += self.finish(step)
        if not rows:
            return {}
        return {k: v for k, v in rows[-1].items() if k != "step"}
