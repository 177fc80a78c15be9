"""Learner rank 0's side of `algorithm.max_staleness: auto` and of fleet advice (asyncrl/control.py).

After every step it hands the controller what the step measured (the wait for data, computing and
push time, the prompts released but not leased, ESS and the capped share), publishes the bound in
force as `staleness_bound` in the `learner` hash (the buffer's admission reads it there:
buffers/prompts.py), sets the staleness filter (learners/reader.py) and logs every move with its
reason. With a fixed bound it only reports: the bound, the fleet advice and the share of tokens in
samples that span weight versions.
"""

from __future__ import annotations

import logging

import numpy as np

from asyncrl.config import Config
from asyncrl.control import FleetAdvisor, StalenessController, StepSignals, fleet_request
from asyncrl.launch.elastic import request_scale
from asyncrl.protocol import schema
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, log_event
from asyncrl.protocol.store import group_lag

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had

SCALE_BACKENDS = ("local", "ray")  # deployments whose driver acts on the run's scale list (asyncrl/launch/elastic.py)


def multi_version_frac(groups: list[schema.TrajectoryGroup]) -> float:
    """The share of a step's completion tokens in samples sampled by more than one weight version
    (weights.mode=keep lets a sequence continue across a weight update)."""
    total = spanning = 0
    for g in groups:
        for s in g.samples:
            versions = schema.unpack_i32(s.versions)
            total += len(versions)
            if len(versions) and int(np.ptp(versions)) > 0:
                spanning += len(versions)
    return spanning / max(total, 1)


def _published_bound(client, keys: Keys) -> int | None:
    raw = client.hget(keys.learner, "staleness_bound")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


class AutoTune:
    def __init__(self, cfg: Config, client, keys: Keys, reader):
        self.cfg, self.client, self.keys, self.reader = cfg, client, keys, reader
        auto = cfg.algorithm.autotune
        self.controller = None
        if auto.enabled and cfg.run.mode == "async":
            self.controller = StalenessController.from_config(auto)
            # A resumed learner goes on from the bound its predecessor published: groups released under
            # it are still in flight, and starting again from the min would drop them as stale.
            self.controller.resume_at(_published_bound(client, keys))
            reader.max_staleness = self.controller.filter_bound
        elif auto.enabled:
            log.info("run.mode=sync: algorithm.max_staleness=auto is ignored (the bound is 0)")
        self.bound = self.controller.bound if self.controller else cfg.algorithm.max_staleness
        self.advisor = FleetAdvisor(wait_high=auto.wait_high)
        self.advice = -1
        self.scale_target = -1  # the fleet size last asked for, until the fleet reaches it
        client.hset(keys.learner, "staleness_bound", self.bound)

    def on_step(self, groups: list[schema.TrajectoryGroup], stats: dict, sync_s: float, num_generators: int,
                data_wait_s: float) -> dict:
        """The step's row fields; moves the bound and asks for generators where it should."""
        sig = StepSignals(wait_s=data_wait_s, busy_s=stats["step_s"] + sync_s,
                          backlog=group_lag(self.client, self.keys.prompts, PROMPT_GROUP),
                          batch_groups=self.cfg.learner.batch_groups, num_generators=num_generators,
                          ess=stats.get("ess"), capped_frac=stats.get("is_capped_frac"))
        row = {"tokens_multi_version_frac": multi_version_frac(groups)}
        if self.controller is not None:
            change = self.controller.observe(sig)
            if change is not None:
                self.bound = change.new
                self.client.hset(self.keys.learner, "staleness_bound", self.bound)
                log.info("staleness bound %d -> %d: %s", change.old, change.new, change.reason)
                log_event(self.client, self.keys, "staleness_bound", old=change.old, new=change.new,
                          reason=change.reason)
                row["staleness_change"] = f"{change.old} -> {change.new}: {change.reason}"
            self.reader.max_staleness = self.controller.filter_bound
        capped = self.controller is None or self.bound >= self.controller.hi
        advice = self.advisor.observe(sig, bound_capped=capped)
        if advice != self.advice and advice > num_generators:
            log.info("fleet advice: %d generators would remove the learner's wait (%d now, waiting %.0f%% of "
                     "its steps)", advice, num_generators, 100 * sig.wait_frac)
        self.advice = advice
        self._scale(advice, num_generators)
        return {**row, "staleness_bound": float(self.bound), "fleet_advice_generators": float(advice)}

    def _scale(self, advice: int, live: int) -> None:
        """algorithm.autotune.fleet_max > 0: asks the deployment for generators (only more: a fleet the
        advisor finds too large for the learner is left to the user), one request at a time."""
        auto = self.cfg.algorithm.autotune
        if auto.fleet_max == 0 or (self.scale_target >= 0 and live < self.scale_target):
            return  # off, or the last request's generators are still starting
        delta = fleet_request(advice, live, auto.fleet_min, auto.fleet_max)
        backend = (self.client.hget(self.keys.deploy, "backend") or b"").decode()
        if delta <= 0 or backend not in SCALE_BACKENDS:
            return
        self.scale_target = live + delta
        request_scale(self.client, self.keys, delta)
        log.info("fleet: asked the %s deployment for %+d generators (%d -> %d)", backend, delta, live, live + delta)
        log_event(self.client, self.keys, "autoscale", delta=delta, live=live, advice=advice)
