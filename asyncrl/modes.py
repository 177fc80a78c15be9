"""`run.mode`: how generation and training are coupled. Rules shared by the buffer and the generators.

- `async` (default): generators keep sampling while the learner trains; staleness is bounded by the
  admission rule with `algorithm.max_staleness`, in-flight sequences continue across weight updates.
- `sync`: the same processes in lockstep, the baseline every async comparison is measured against.
  The buffer releases exactly `learner.batch_groups` prompts per learner version (admission with
  staleness 0), and a generator starts a group only while the version it holds equals the learner's
  current version (the Redis `version` key). Every released group belongs to the current version's
  batch, so the learner cannot step before all of them are in, and no token is ever stale (lag 0):
  the learner waits for each batch, the generators wait for each weight sync.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config import Config

log = logging.getLogger(__name__)

_said_ignored = False


def admission_staleness(cfg: Config, live: bytes | str | int | None = None) -> int:
    """The staleness bound the buffer's admission rule uses: 0 in sync mode, else algorithm.max_staleness,
    or under max_staleness=auto `live`, the learner's bound in force (the `learner` hash's
    `staleness_bound`), kept within algorithm.autotune's limits (its min before the learner wrote one)."""
    global _said_ignored
    auto = cfg.algorithm.autotune
    if cfg.run.mode != "sync" and auto.enabled:
        return min(max(int(live), auto.min), auto.max) if live is not None else auto.min
    if cfg.run.mode != "sync":
        return cfg.algorithm.max_staleness
    if cfg.algorithm.max_staleness != 0 and not _said_ignored:
        _said_ignored = True
        log.info("run.mode=sync: admission uses staleness 0; algorithm.max_staleness=%d is ignored for admission",
                 cfg.algorithm.max_staleness)
    return 0


def may_generate(mode: str, held_version: int, learner_version: int) -> bool:
    """Whether a generator holding `held_version` may start a group now (sync: only with current weights)."""
    if held_version < 0:
        return False
    return mode != "sync" or held_version == learner_version
