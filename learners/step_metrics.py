"""Learner rank 0's row of a step: the metrics logged (asyncrl/observe/metrics.py), the `learner`
hash in Redis, and the step's line on standard output (names in docs/metrics.md).
"""

from __future__ import annotations

import time

from asyncrl.config import Config
from asyncrl.observe.episodes import episode_metrics
from asyncrl.observe.metrics import FleetTokenRate, LearnerObservability, WindowRate
from asyncrl.protocol import schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys
from asyncrl.protocol.store import group_lag
from learners.evaluation import Evaluator
from learners.feed import Feed
from learners.push import Pusher


class StepMetrics:
    def __init__(self, cfg: Config, client, keys: Keys, version: int, resumed: bool, t_start: float):
        self.cfg, self.client, self.keys = cfg, client, keys
        self.resumed, self.t_start = resumed, t_start
        self.metrics_path = cfg.run_dir / "metrics.jsonl"
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        self.obs = LearnerObservability(cfg, client, keys)  # jsonl/wandb/TensorBoard, /metrics
        # eval rounds every eval.every steps (asyncrl/tasks/evaluation.py)
        self.evaluator = Evaluator(cfg, client, start_version=version)
        self.gen_rate = FleetTokenRate(start=t_start)
        self.learn_rate = WindowRate(start=t_start)

    def after_step(self, step: int, version: int, groups: list[schema.TrajectoryGroup], stats: dict,
                   sync_s: float, fleet: dict[str, schema.Heartbeat], feed: Feed, pusher: Pusher) -> None:
        """The step's row; `fleet` is the heartbeat snapshot read after the step (its weight check
        ran on it), used for the generator metrics. This step's waits (`feed.data_wait_s`,
        `pusher.push_wait_s`) and the push collected since the last row start again from none."""
        row, rewards = self._row(step, version, groups, stats, sync_s, fleet, feed, pusher)
        feed.data_wait_s = pusher.push_wait_s = 0.0
        pusher.last_push = None
        baselines = [g.baseline_reward for g in groups if g.baseline_reward is not None]
        if baselines:  # advantage=remax: the greedy completions' rewards the samples were measured against
            row["baseline_reward_mean"] = sum(baselines) / len(baselines)
        row.update(episode_metrics(groups))  # episode/*: multi-turn episodes' turns, tool calls, environment time
        row.update(self.evaluator.after_step(step, version))  # eval/* of a round that finished
        self.obs.on_step(row, rewards, fleet)  # adds reward quantiles, dropped fraction, fleet metrics
        self.client.hset(self.keys.learner, mapping={"step": step, "version": version,
                                                     "idle_ratio": row["idle_ratio"], "updated_at": time.time(),
                                                     "tokens_per_s": row["learner_tokens_per_s"],
                                                     **{k: row[k] for k in ("compute_s", "data_wait_s", "sync_s",
                                                                            "push_wait_s", "mfu", "tflops")}})
        print(f"step={step:4d} version={version:4d} reward={row['reward_mean']:.3f} "
              f"lag={row['lag_mean']:.2f}/{row['lag_max']} dropped_stale={feed.dropped_stale} "
              f"dropped_frac={row['dropped_frac']:.3f} "
              f"gen_tok/s={row['gen_tokens_per_s']:8.1f} learn_tok/s={row['learner_tokens_per_s']:8.1f} "
              f"compute_s={row['compute_s']:.3f} tflops={row['tflops']:.3g} mfu={row['mfu']:.3f} "
              f"wait_s={row['data_wait_s']:.3f} "
              f"sync_s={sync_s:.3f} depth={row['buffer_depth']} loss={stats['loss']:+.4f}", flush=True)

    def _row(self, step: int, version: int, groups: list[schema.TrajectoryGroup], stats: dict, sync_s: float,
             fleet: dict[str, schema.Heartbeat], feed: Feed, pusher: Pusher) -> tuple[dict, list[float]]:
        """(the row before evaluation and the fleet's metrics, the step's rewards)."""
        trained_version = version - 1
        lags = []
        for g in groups:
            for s in g.samples:
                lags.extend((trained_version - schema.unpack_i32(s.versions)).tolist())
        rewards = [s.reward for g in groups for s in g.samples]
        counters = {gid: float(hb.tokens) for gid, hb in fleet.items()}
        if self.resumed and not self.gen_rate.counters:
            self.gen_rate.counters = dict(counters)  # made before this learner started: not in its window
        gen_tps = self.gen_rate.update(counters, time.monotonic())
        learn_tps = self.learn_rate.add(stats["tokens"], time.monotonic())
        elapsed = time.monotonic() - self.t_start
        depth = group_lag(self.client, self.keys.trajectories, LEARNER_GROUP)
        check = pusher.fleet.weight_check
        row = {
            "step": step, "version": version, "time": time.time(), "elapsed_s": elapsed,
            "reward_mean": sum(rewards) / len(rewards), "reward_max": max(rewards),
            "lag_mean": sum(lags) / max(len(lags), 1), "lag_max": max(lags) if lags else 0,
            "lag_hist": {str(k): lags.count(k) for k in sorted(set(lags))},
            "dropped_stale": feed.dropped_stale, "dropped_zero_var": feed.dropped_zero_var,
            # prompts of dropped groups sent back to be sampled again (too stale; ahead of a resumed learner)
            "requeued_stale": feed.reader.num_requeued["stale"],
            "requeued_ahead": feed.reader.num_requeued["ahead"] + feed.requeued_ahead,
            "quarantined": feed.quarantine.num,
            "num_groups": len(groups),
            "gen_tokens_per_s": gen_tps, "learner_tokens_per_s": learn_tps,
            "learner_step_tokens_per_s": stats["tokens"] / max(stats["step_s"], 1e-9),
            "sync_s": sync_s, "buffer_depth": depth, "idle_ratio": feed.idle_s / max(elapsed, 1e-9),
            "num_generators": len(fleet), "weights_verified": check.num_verified,
            "weights_mismatch": check.num_mismatch,
            "generators_in_batch": sorted({g.generator_id for g in groups}),
            **{k: v for k, v in stats.items() if k not in ("tokens",)}, "tokens": stats["tokens"],
            "sample_age_s": time.time() - min(g.created_at for g in groups),
            # Where the learner's time went since the last row: computing the step, waiting for a batch,
            # waiting for the previous push (within sync_s, which adds gathering and staging this one).
            "compute_s": stats["step_s"], "data_wait_s": feed.data_wait_s, "push_wait_s": pusher.push_wait_s,
        }
        if (push := pusher.last_push) is not None:  # the push collected since the last row: when it started, was done
            row.update(push_version=push.version, push_started_at=push.started_at, push_done_at=push.done_at,
                       push_s=push.done_at - push.started_at)
        return row, rewards
