"""`algorithm.max_staleness: auto`: the staleness bound moved in closed loop, and fleet advice.

Pure Python, no I/O: the learner (learners/autotune.py) and the pipeline simulator
(asyncrl/tools/simulate.py) feed the same `StalenessController` the same per-step signals.

The bound is the in-flight budget: the buffer releases (version + bound + 1) * batch_groups prompts
in total (buffers/prompts.py), so one more version of staleness is one more step's worth of groups
in flight. The rules, each with its reason logged when it moves the bound:

- up: over the steps since the last move (`patience`, and at least two waves of bound + 1 steps:
  that many steps' prompts are out at once, so batches arrive in waves) the learner waited for
  data more than `wait_high` of its time. Each rise is judged on as many steps after it: if the learner's wait
  a step did not fall by `min_gain` of what it was, the rise is taken back and its value is not
  tried again while the fleet keeps its size (more in flight did not help: the engines are full,
  and only more generators would; see `FleetAdvisor`);
- down: the off-policy guard, ESS below `ess_floor` or the capped share above `capped_max` for
  `patience` steps; the bound it leaves is a ceiling.

Damping: after a move the controller rests two waves of bound + 1 steps (the groups the move
released or held back take that long to reach the learner and the waves to settle) and then averages a fresh window of steps, ceilings last
`relax_steps` steps, and nothing lowers the bound for throughput: without the guard the bound only
rises, and a rise that did not pay is taken back once per fleet size. The learner's staleness filter keeps the highest bound of the
last max + 1 steps (`filter_bound`): groups released under a bound are never dropped because the
guard lowered it after their release.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class StepSignals:
    """What one step measured. `wait_s`: the learner's wait for data since the last step; `busy_s`:
    its computing and weight push; `backlog`: prompts released but not leased at the step's end;
    `ess`, `capped_frac`: the step's importance-weight tails (None: the loss has none)."""

    wait_s: float
    busy_s: float
    backlog: int
    batch_groups: int
    num_generators: int
    ess: float | None = None
    capped_frac: float | None = None

    @property
    def wait_frac(self) -> float:
        return self.wait_s / max(self.wait_s + self.busy_s, 1e-9)

    @property
    def generators_full(self) -> bool:
        """Released prompts wait unleased: every generator has all the groups it runs at once."""
        return self.backlog * 2 >= max(self.batch_groups, 1)


@dataclass(frozen=True)
class Change:
    step: int
    old: int
    new: int
    reason: str


class StalenessController:
    """The bound in force (`bound`), moved by `observe` once per learner step."""

    REST_WAVES = 2  # steps of rest after a move, in waves of bound + 1 (the simulator's sweep chose 2 and 2)
    WINDOW_WAVES = 2

    def __init__(self, lo: int, hi: int, wait_high: float = 0.1, patience: int = 3, ess_floor: float = 0.8,
                 capped_max: float = 0.05, relax_steps: int = 100, min_gain: float = 0.05):
        assert 0 <= lo <= hi, (lo, hi)
        self.lo, self.hi, self.wait_high, self.patience = lo, hi, wait_high, patience
        self.ess_floor, self.capped_max, self.relax_steps, self.min_gain = ess_floor, capped_max, relax_steps, min_gain
        self.bound = lo
        self.ceiling, self.ceiling_step = hi, 0
        self.step = 0
        self.rest = 0  # steps left before the next move may be considered
        self.window: deque[tuple[float, float]] = deque()  # (wait_s, busy_s) of the steps since the last move
        self.num_off_policy = 0
        self.wait_before: float | None = None  # mean wait per step before the last rise, to judge it by
        self.history: deque[int] = deque([lo], maxlen=hi + 1)
        self.changes: list[Change] = []
        self.num_generators = -1
        self.ceiling_relaxes = True  # a guard's ceiling relaxes; one from a rise that did not pay lasts the fleet

    def resume_at(self, bound: int | None) -> None:
        """Starts from `bound` (kept within [lo, hi]) instead of lo: a resumed learner's predecessor's."""
        if bound is not None:
            self.bound = min(self.hi, max(self.lo, bound))
            self.history = deque([self.bound], maxlen=self.hi + 1)

    @classmethod
    def from_config(cls, auto) -> StalenessController:
        """From `algorithm.autotune` (asyncrl/config.py AutotuneConfig)."""
        return cls(auto.min, auto.max, auto.wait_high, auto.patience, auto.ess_floor, auto.capped_max,
                   auto.relax_steps)

    @property
    def filter_bound(self) -> int:
        """The bound the learner's staleness filter uses: the highest in force over the last max + 1
        steps, so that a pull-back does not drop groups already released under the old bound."""
        return max(self.history)

    @property
    def num_direction_changes(self) -> int:
        signs = [1 if c.new > c.old else -1 for c in self.changes]
        return sum(1 for a, b in zip(signs, signs[1:], strict=False) if a != b)

    def observe(self, sig: StepSignals) -> Change | None:
        """Takes one step's signals; returns the change it made, if any."""
        self.step += 1
        change = None
        if self.step > 1:  # the first step's wait is the pipeline filling (engines starting, first batch)
            change = self._decide(sig)
        self.history.append(self.bound)
        return change

    def _decide(self, sig: StepSignals) -> Change | None:
        off_policy = self._off_policy_reason(sig)
        self.num_off_policy = self.num_off_policy + 1 if off_policy else 0
        if sig.num_generators != self.num_generators:  # another fleet: what paid before may differ now
            self.num_generators, self.ceiling, self.ceiling_relaxes = sig.num_generators, self.hi, True
            self.window.clear()
        if self.ceiling_relaxes and self.ceiling < self.hi and self.step - self.ceiling_step >= self.relax_steps:
            self.ceiling = self.hi
        if self.rest > 0:  # the wave of groups released (or held back) by the last move is still on its way
            self.rest -= 1
            return None
        self.window.append((sig.wait_s, sig.busy_s))
        if self.num_off_policy >= self.patience and self.bound > self.lo:
            change = self._move(self.bound - 1, f"off-policy guard: {off_policy} for {self.num_off_policy} steps")
            self.wait_before = None  # a rise the guard took back is not judged any more
            self.ceiling, self.ceiling_step, self.ceiling_relaxes = self.bound, self.step, True
            return change
        # Batches arrive in waves of bound + 1 (that many steps' prompts are out at once): a window of two
        # waves reads the same whatever the phase it starts at.
        need = max(self.patience, self.WINDOW_WAVES * (self.bound + 1))
        while len(self.window) > need:
            self.window.popleft()
        if len(self.window) < need:
            return None
        wait = sum(w for w, _ in self.window) / len(self.window)
        share = wait / max(wait + sum(b for _, b in self.window) / len(self.window), 1e-9)
        if self.wait_before is not None:  # the last rise, judged on as many steps as led to it
            before, self.wait_before = self.wait_before, None
            if wait > before * (1 - self.min_gain):  # taken back, and not tried again on this fleet
                change = self._move(self.bound - 1, f"the rise to {self.bound} did not shorten the learner's wait "
                                    f"({before:.2f}s -> {wait:.2f}s a step)")
                self.ceiling, self.ceiling_step, self.ceiling_relaxes = self.bound, self.step, False
                return change
        if share > self.wait_high and self.bound < self.ceiling:
            self.wait_before = wait
            return self._move(self.bound + 1, f"learner waited {share:.0%} of its steps ({wait:.2f}s a step) "
                              f"over the last {len(self.window)} steps")
        return None

    def _off_policy_reason(self, sig: StepSignals) -> str:
        if sig.ess is not None and sig.ess < self.ess_floor:
            return f"ess {sig.ess:.3f} < {self.ess_floor}"
        if sig.capped_frac is not None and sig.capped_frac > self.capped_max:
            return f"capped share {sig.capped_frac:.3f} > {self.capped_max}"
        return ""

    def _move(self, new: int, reason: str) -> Change:
        change = Change(self.step, self.bound, new, reason)
        self.bound = new
        self.rest = self.REST_WAVES * (new + 1)
        self.window.clear()
        self.num_off_policy = 0
        self.changes.append(change)
        return change


class FleetAdvisor:
    """How many generators would remove the learner's wait for data, from smoothed step signals.

    With N generators the learner gets a batch every wait + busy seconds and could take one every
    busy seconds; generation scales with the fleet, so N * (wait + busy) / busy generators keep up.
    Advice above N is given only while generation is the bottleneck: the learner waits and either
    the generators are full (prompts wait unleased) or the bound is at its cap."""

    def __init__(self, alpha: float = 0.2, wait_high: float = 0.1):
        self.alpha, self.wait_high = alpha, wait_high
        self.wait_s = self.busy_s = None

    def observe(self, sig: StepSignals, bound_capped: bool) -> int:
        a = self.alpha
        self.wait_s = sig.wait_s if self.wait_s is None else (1 - a) * self.wait_s + a * sig.wait_s
        self.busy_s = sig.busy_s if self.busy_s is None else (1 - a) * self.busy_s + a * sig.busy_s
        num = max(sig.num_generators, 1)
        wait_frac = self.wait_s / max(self.wait_s + self.busy_s, 1e-9)
        if wait_frac <= self.wait_high or not (sig.generators_full or bound_capped):
            return sig.num_generators
        return math.ceil(num * (self.wait_s + self.busy_s) / max(self.busy_s, 1e-9) - 1e-9)


def fleet_request(advice: int, live: int, fleet_min: int, fleet_max: int) -> int:
    """The signed number of generators to add (> 0) or remove (< 0) to follow `advice` within
    [fleet_min, fleet_max]; 0 when nothing should move."""
    target = min(max(advice, fleet_min), fleet_max)
    return target - live
