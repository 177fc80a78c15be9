"""`asyncrl simulate`: a discrete-event model of the generator -> buffer -> learner pipeline.

Pure Python (heapq, random); no torch, no Redis. It models what decides throughput and staleness:

- generators: `num_generators` engines, each with at most `max_concurrent_groups` groups of `n`
  sequences in flight. Running sequences share the engine by processor sharing: each advances at
  min(seq_tokens_per_s, gen_tokens_per_s / running) tokens/s (the first term is the per-step decode
  speed, the second the engine's saturated throughput). Completion lengths are lognormal
  (`len_mean`, `len_sigma`: the long tail), capped at `max_tokens`. A finished group reaches the
  learner `group_latency_s` later (scoring, push, ingest);
- the buffer's admission rule: released groups <= (version + staleness + 1) * batch_groups + dropped;
- the learner: waits for `batch_groups` groups, drops those whose oldest token lags more than
  `max_staleness`, trains for `learner_overhead_s + tokens / learner_tokens_per_s`, bumps the version
  and broadcasts for `sync_s` (engines are paused meanwhile);
- `overlap_slowdown`: generators run this many times slower while the learner trains (> 1 when the
  two stages share cores or a device; 1 when each has its own).

Modes (`mode`): `sync` (staleness 0; a generator starts a group only with the learner's current
weights, as `run.mode=sync`), `one_step_off` (staleness 1; batch k+1 is generated with weights k-1's
successor while batch k trains, and weights move only at a barrier after both finish: lag exactly
1), `async` (staleness `max_staleness`; weights change under in-flight sequences at every sync, as
`run.mode=async` with `weights.mode=keep`).

`autotune=1` (async only): the staleness bound is moved each step by asyncrl/control.py's
`StalenessController`, the code the learner runs under `algorithm.max_staleness: auto`, fed the same
signals (the learner's wait and busy time since the last step, the released prompts no engine has
leased, the batch's ESS), within [auto_min, auto_max]; admission follows its bound and the staleness
filter its `filter_bound`. The simulator has no policy: `ess_drift` > 0 gives each batch a synthetic
ESS of exp(-ess_drift * lag mean) to exercise the off-policy guard; 0 gives none.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from asyncrl.control import FleetAdvisor, StalenessController, StepSignals

MODES = ("sync", "one_step_off", "async")


@dataclass
class SimConfig:
    mode: str = "async"
    num_generators: int = 1
    gen_tokens_per_s: float = 1000.0  # one engine's saturated throughput
    seq_tokens_per_s: float = 50.0  # one sequence's decode speed (engine steps/s)
    max_concurrent_groups: int = 16
    n: int = 8
    len_mean: float = 100.0
    len_sigma: float = 0.0  # lognormal sigma of completion lengths; 0: all len_mean
    max_tokens: int = 1024
    group_latency_s: float = 0.0
    batch_groups: int = 8
    learner_tokens_per_s: float = 5000.0
    learner_overhead_s: float = 0.0
    sync_s: float = 0.1  # the learner's weight broadcast
    gen_pause_s: float = 0.1  # how long an engine stops generating at each sync (async modes)
    max_staleness: int = 1
    overlap_slowdown: float = 1.0
    steps: int = 30
    seed: int = 0
    autotune: int = 0  # 1: the bound moves in closed loop (asyncrl/control.py) within [auto_min, auto_max]
    auto_min: int = 1
    auto_max: int = 8
    ess_drift: float = 0.0  # > 0: synthetic batch ESS exp(-ess_drift * lag mean) for the off-policy guard


@dataclass
class SimResult:
    config: dict
    wall_s: float  # from t=0 (all processes up) to the last step's end
    window_s: float  # first step's end to the last step's end
    trained_tokens_per_s: float  # over the window (as benchmarks/async_vs_sync.py measures)
    trained_tokens: int
    lag_mean: float  # token-weighted
    lag_max: int
    lag_hist: dict[str, int]
    learner_idle_ratio: float  # over the window
    generator_idle_ratio: float  # over the window, mean over generators
    dropped_stale: int
    step_times: list[float] = field(repr=False, default_factory=list)
    step_tokens: list[int] = field(repr=False, default_factory=list)
    bounds: list[int] = field(repr=False, default_factory=list)  # the bound in force after each step
    changes: list[dict] = field(default_factory=list)  # autotune: each move of the bound, with its reason
    direction_changes: int = 0
    fleet_advice: list[int] = field(repr=False, default_factory=list)  # generators advised after each step


class _Gen:
    __slots__ = ("idx", "t", "vclock", "heap", "groups", "version", "segments", "idle_s", "idle_since", "stamp")

    def __init__(self, idx: int):
        self.idx = idx
        self.t = 0.0  # time `vclock` was last advanced to
        self.vclock = 0.0  # tokens every running sequence has received since start (processor sharing)
        self.heap: list[tuple[float, int, int]] = []  # (finish vclock, seq uid, group uid)
        self.groups: dict[int, dict] = {}
        self.version = 0
        self.segments = [(0.0, 0)]  # (vclock at change, version): which version sampled which tokens
        self.idle_s = 0.0
        self.idle_since: float | None = 0.0
        self.stamp = 0


class Simulator:
    def __init__(self, cfg: SimConfig):
        assert cfg.mode in MODES, cfg.mode
        self.c = cfg
        self.rng = random.Random(cfg.seed)
        self.staleness = {"sync": 0, "one_step_off": 1, "async": cfg.max_staleness}[cfg.mode]
        self.controller = None
        if cfg.autotune:
            assert cfg.mode == "async", "autotune moves the async bound"
            self.controller = StalenessController(cfg.auto_min, cfg.auto_max)
            self.staleness = self.controller.bound
        self.filter_staleness = self.staleness  # the staleness filter's bound (the controller's filter_bound)
        self.advisor = FleetAdvisor()
        self.bounds: list[int] = []
        self.advice: list[int] = []
        self._batch_lag = 0.0
        self._last_idle = 0.0
        self.t = 0.0
        self.events: list[tuple[float, int, str, int, int]] = []  # (t, seq, kind, gen idx, stamp)
        self._seq = 0
        self.gens = [_Gen(i) for i in range(cfg.num_generators)]
        self.free = set(self.gens)  # generators with a free slot
        self.version = 0  # the learner's
        self.admit_version = 0  # what the buffer's admission rule sees
        self.released = self.leased = self.completed = 0
        self.dropped = 0
        self.queue: list[dict] = []  # finished groups the learner has not taken
        self.learner = "wait"  # wait | train | barrier | sync
        self.paused = False
        self.learner_idle_s, self._idle_since = 0.0, 0.0
        self.step_ends: list[float] = []
        self.idle_at_step: list[float] = []
        self.gen_idle_at_step: list[float] = []
        self.trained_tokens: list[int] = []
        self.lags: dict[int, int] = {}
        self.uid = 0
        if cfg.mode == "sync":
            assert self.staleness == 0

    # ---- events ----------------------------------------------------------------------------------

    def _push(self, t: float, kind: str, idx: int = -1, stamp: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, idx, stamp))

    def _rate(self, g: _Gen) -> float:
        running = len(g.heap)
        if self.paused or running == 0:
            return 0.0
        r = min(self.c.seq_tokens_per_s, self.c.gen_tokens_per_s / running)
        return r / self.c.overlap_slowdown if self.learner == "train" else r

    def _advance(self, g: _Gen) -> None:
        g.vclock += self._rate(g) * (self.t - g.t)
        g.t = self.t

    def _reschedule(self, g: _Gen) -> None:
        g.stamp += 1
        rate = self._rate(g)
        if g.heap and rate > 0:
            self._push(self.t + max(g.heap[0][0] - g.vclock, 0.0) / rate, "seq_done", g.idx, g.stamp)

    def _rates_change(self, change) -> None:
        """Applies a change that alters every engine's rate (pause, learner starts/stops training)."""
        for g in self.gens:
            self._advance(g)
        change()
        for g in self.gens:
            self._reschedule(g)

    # ---- generators ------------------------------------------------------------------------------

    def _sample_len(self) -> int:
        c = self.c
        if c.len_sigma <= 0:
            return max(1, min(c.max_tokens, round(c.len_mean)))
        mu = math.log(c.len_mean) - c.len_sigma ** 2 / 2  # so that the mean is len_mean before the cap
        return max(1, min(c.max_tokens, round(self.rng.lognormvariate(mu, c.len_sigma))))

    def _may_lease(self, g: _Gen) -> bool:
        if self.c.mode == "sync":
            return g.version == self.version and self.learner != "sync"
        if self.c.mode == "one_step_off":
            return self.learner not in ("sync",)
        return True

    def _release(self) -> None:
        budget = (self.admit_version + self.staleness + 1) * self.c.batch_groups + self.dropped
        self.released = max(self.released, budget)

    def _lease_all(self) -> None:
        self._release()
        for g in sorted(self.free, key=lambda g: g.idx):  # index order: a set of objects iterates by address
            if self.leased >= self.released:
                return
            if not self._may_lease(g):
                continue
            started = False
            while len(g.groups) < self.c.max_concurrent_groups and self.leased < self.released:
                if not started:
                    self._advance(g)
                    started = True
                self._start_group(g)
            if len(g.groups) >= self.c.max_concurrent_groups:
                self.free.discard(g)
            if started:
                if g.idle_since is not None:
                    g.idle_s += self.t - g.idle_since
                    g.idle_since = None
                self._reschedule(g)

    def _start_group(self, g: _Gen) -> None:
        self.leased += 1
        self.uid += 1
        gid = self.uid
        g.groups[gid] = {"left": self.c.n, "tokens": {}, "start_version": g.version}
        for _ in range(self.c.n):
            self.uid += 1
            length = self._sample_len()
            heapq.heappush(g.heap, (g.vclock + length, self.uid, gid))
            g.groups[gid].setdefault("seqs", {})[self.uid] = (g.vclock, length)

    def _seq_done(self, g: _Gen) -> None:
        self._advance(g)
        while g.heap and g.heap[0][0] <= g.vclock + 1e-9:
            _, uid, gid = heapq.heappop(g.heap)
            grp = g.groups[gid]
            start, length = grp["seqs"].pop(uid)
            # Tokens [start, start + length) of this engine's clock, split by the version that sampled them.
            end = start + length
            for i, (v_at, version) in enumerate(g.segments):
                nxt = g.segments[i + 1][0] if i + 1 < len(g.segments) else math.inf
                lo, hi = max(start, v_at), min(end, nxt)
                if hi > lo:
                    grp["tokens"][version] = grp["tokens"].get(version, 0) + round(hi - lo)
            grp["left"] -= 1
            if grp["left"] == 0:
                del g.groups[gid]
                self.free.add(g)
                self._push(self.t + self.c.group_latency_s, "arrive", -1, 0)
                self._arrivals.append(grp)
        if not g.groups and g.idle_since is None:
            g.idle_since = self.t
        self._lease_all()
        self._reschedule(g)

    # ---- learner ---------------------------------------------------------------------------------

    def _try_train(self) -> None:
        if self.learner != "wait":
            return
        if self._filtered != (self.version, len(self.queue)):
            keep = []
            for grp in self.queue:
                if grp["tokens"] and self.version - min(grp["tokens"]) > self.filter_staleness:
                    self.dropped += 1  # acked, counted, its prompt given back to the admission budget
                else:
                    keep.append(grp)
            self.queue = keep
            self._filtered = (self.version, len(self.queue))
        if len(self.queue) < self.c.batch_groups:
            self._lease_all()
            return
        batch, self.queue = self.queue[:self.c.batch_groups], self.queue[self.c.batch_groups:]
        tokens = sum(sum(grp["tokens"].values()) for grp in batch)
        lag_sum = 0
        for grp in batch:
            for version, num in grp["tokens"].items():
                self.lags[self.version - version] = self.lags.get(self.version - version, 0) + num
                lag_sum += (self.version - version) * num
        self._batch_lag = lag_sum / max(tokens, 1)
        self.learner_idle_s += self.t - self._idle_since
        self.trained_tokens.append(tokens)
        self._rates_change(lambda: setattr(self, "learner", "train"))
        self._push(self.t + self.c.learner_overhead_s + tokens / self.c.learner_tokens_per_s, "train_done")

    def _train_done(self) -> None:
        self.version += 1
        if self.c.mode != "one_step_off":
            self.admit_version = self.version
        self._rates_change(lambda: setattr(self, "learner", "barrier"))
        self._barrier_since = self.t
        self._maybe_sync()

    def _maybe_sync(self) -> None:
        # one_step_off: weights move only once every released group is finished (the batch barrier).
        if self.learner != "barrier":
            return
        if self.c.mode == "one_step_off" and self.completed < self.released:
            self._lease_all()
            return
        self.learner_idle_s += self.t - self._barrier_since  # waiting at the barrier is waiting for data
        self._rates_change(lambda: (setattr(self, "learner", "sync"), setattr(self, "paused", True)))
        self._push(self.t + self.c.sync_s, "sync_done")
        if self.c.gen_pause_s < self.c.sync_s:  # engines stop only while they receive
            self._push(self.t + self.c.gen_pause_s, "resume")

    def _sync_done(self) -> None:
        def apply():
            self.learner, self.paused = "wait", False
            for g in self.gens:
                g.version = self.version
                g.segments.append((g.vclock, self.version))

        self._rates_change(apply)
        if self.c.mode == "one_step_off":
            self.admit_version = self.version
        self.step_ends.append(self.t)
        self.idle_at_step.append(self.learner_idle_s)
        self.gen_idle_at_step.append(self._gen_idle_total())
        self._idle_since = self.t
        self._lease_all()
        self._control()
        self._try_train()

    def _control(self) -> None:
        """After each step: the controller and the fleet advisor see what the learner would measure."""
        c, ends = self.c, self.step_ends
        interval = ends[-1] - (ends[-2] if len(ends) > 1 else 0.0)
        wait = self.learner_idle_s - self._last_idle
        self._last_idle = self.learner_idle_s
        sig = StepSignals(wait_s=wait, busy_s=max(interval - wait, 0.0), backlog=self.released - self.leased,
                          batch_groups=c.batch_groups, num_generators=c.num_generators,
                          ess=math.exp(-c.ess_drift * self._batch_lag) if c.ess_drift > 0 else None)
        if self.controller is not None:
            if self.controller.observe(sig) is not None:
                self.staleness = self.controller.bound
                self._filtered = (-1, 0)
                self._lease_all()
            self.filter_staleness = self.controller.filter_bound
        self.bounds.append(self.staleness)
        capped = self.controller is None or self.controller.bound >= self.controller.hi
        self.advice.append(self.advisor.observe(sig, bound_capped=capped))

    def _gen_idle_total(self) -> float:
        return sum(g.idle_s + (self.t - g.idle_since if g.idle_since is not None else 0.0) for g in self.gens)

    # ---- run -------------------------------------------------------------------------------------

    def run(self) -> SimResult:
        self._arrivals: deque[dict] = deque()
        self._filtered = (-1, 0)  # (version, queue length) the staleness filter last saw
        self._lease_all()
        while len(self.step_ends) < self.c.steps:
            assert self.events, "simulation deadlocked"
            self.t, _, kind, idx, stamp = heapq.heappop(self.events)
            if kind == "seq_done":
                g = self.gens[idx]
                if stamp == g.stamp:
                    self._seq_done(g)
            elif kind == "arrive":
                self.completed += 1
                grp = self._arrivals.popleft()
                if grp["tokens"] and self.version - min(grp["tokens"]) > self.filter_staleness:
                    self.dropped += 1
                else:
                    self.queue.append(grp)
                    if self._filtered[0] == self.version:
                        self._filtered = (self.version, len(self.queue))
                self._try_train()
                self._maybe_sync()
            elif kind == "train_done":
                self._train_done()
            elif kind == "sync_done":
                self._sync_done()
            elif kind == "resume" and self.learner == "sync":
                self._rates_change(lambda: setattr(self, "paused", False))
        return self._result()

    def _result(self) -> SimResult:
        ends = self.step_ends
        window = ends[-1] - ends[0] if len(ends) > 1 else ends[-1]
        tokens_after_first = sum(self.trained_tokens[1:len(ends)])
        num = max(sum(self.lags.values()), 1)
        gen_idle = (self.gen_idle_at_step[-1] - self.gen_idle_at_step[0]) / len(self.gens) if len(ends) > 1 else 0
        return SimResult(
            config=asdict(self.c), wall_s=ends[-1], window_s=window,
            trained_tokens_per_s=tokens_after_first / max(window, 1e-12),
            trained_tokens=sum(self.trained_tokens[:len(ends)]),
            lag_mean=sum(k * v for k, v in self.lags.items()) / num, lag_max=max(self.lags, default=0),
            lag_hist={str(k): self.lags[k] for k in sorted(self.lags)},
            learner_idle_ratio=(self.idle_at_step[-1] - self.idle_at_step[0]) / max(window, 1e-12),
            generator_idle_ratio=gen_idle / max(window, 1e-12), dropped_stale=self.dropped, step_times=ends,
            step_tokens=self.trained_tokens[:len(ends)], bounds=self.bounds, fleet_advice=self.advice,
            changes=[asdict(ch) for ch in self.controller.changes] if self.controller else [],
            direction_changes=self.controller.num_direction_changes if self.controller else 0)


def simulate(cfg: SimConfig) -> SimResult:
    return Simulator(cfg).run()


# ---- calibration from a real run -----------------------------------------------------------------


def load_run(run_dir: str | Path) -> tuple[dict, list[dict]]:
    """(config.yaml as a dict, metrics.jsonl rows) of a run directory."""
    import yaml

    run_dir = Path(run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) < 3:
        raise ValueError(f"{run_dir}/metrics.jsonl has {len(rows)} steps; calibration needs at least 3")
    return cfg, rows


def _gen_rates(rows: list[dict]) -> tuple[float, float] | None:
    """(tokens per generating second, seconds paused per sync) of one engine, from the heartbeat
    fields logged in each row: generated tokens / (wall - idle - paused for weight syncs)."""
    rates, pauses = [], []
    ids = {k.split("/")[1] for r in rows for k in r if k.startswith("gen/") and k.endswith("/idle_s")}
    for gid in ids:
        tk, ik = f"gen/{gid}/tokens", f"gen/{gid}/idle_s"
        have = [r for r in rows if tk in r and ik in r]
        if len(have) < 2:
            continue
        a, b = have[0], have[-1]
        paused = b.get(f"gen/{gid}/sync_s_total", 0) - a.get(f"gen/{gid}/sync_s_total", 0)
        busy = (b["time"] - a["time"]) - (b[ik] - a[ik]) - paused
        if busy > 0 and b[tk] > a[tk]:
            rates.append((b[tk] - a[tk]) / busy)
            pauses.append(paused / max(b["step"] - a["step"], 1))
    return (statistics.mean(rates), statistics.mean(pauses)) if rates else None


def calibrate(run_cfg: dict, rows: list[dict], **overrides) -> SimConfig:
    """A SimConfig from a real run: its config.yaml and metrics.jsonl rows.

    Learner: trained tokens / training seconds; median sync seconds; the mean per-step overhead
    (step interval minus training, sync and waiting). Generators: tokens per generating second and
    seconds paused per sync (from the `gen/{id}/tokens`, `idle_s` and `sync_s_total` heartbeat
    fields in the rows), the rate taken as the engine's throughput with every slot full; the
    per-sequence speed is that divided by the sequences in flight (a small model's decode step
    costs about the same at any batch size). Lengths: mean completion tokens per sample; the rows
    carry no length distribution, so `len_sigma` stays 0 unless given.
    """
    gen, lrn, alg = run_cfg["generator"], run_cfg["learner"], run_cfg["algorithm"]
    steady = rows[1:]
    learner_tps = sum(r["tokens"] for r in steady) / sum(r["step_s"] for r in steady)
    sync_s = statistics.median(r["sync_s"] for r in steady)
    gaps = []
    for a, b in zip(rows, rows[1:], strict=False):
        idle = b["idle_ratio"] * b["elapsed_s"] - a["idle_ratio"] * a["elapsed_s"]
        gaps.append(max(b["time"] - a["time"] - idle - b["step_s"] - b["sync_s"], 0.0))
    slots = gen["n"] * gen["max_concurrent_groups"]
    rates = _gen_rates(rows)
    if rates is None:
        raise ValueError("the run's metrics have no gen/{id}/idle_s fields (a run from before they were logged)")
    busy_rate, pause_s = rates
    len_mean = statistics.mean(r["tokens"] / (r["num_groups"] * gen["n"]) for r in steady)
    num_gens = max(int(statistics.median(r.get("num_generators", gen["num_generators"]) for r in steady)), 1)
    mode = "sync" if run_cfg["run"]["mode"] == "sync" else "async"
    cfg = SimConfig(mode=mode, num_generators=num_gens, gen_tokens_per_s=busy_rate,
                    seq_tokens_per_s=busy_rate / slots, max_concurrent_groups=gen["max_concurrent_groups"],
                    n=gen["n"], len_mean=len_mean, len_sigma=0.0, max_tokens=gen["max_tokens"],
                    batch_groups=lrn["batch_groups"], learner_tokens_per_s=learner_tps,
                    learner_overhead_s=statistics.mean(gaps), sync_s=sync_s, gen_pause_s=pause_s,
                    max_staleness=alg["max_staleness"], steps=len(rows))
    return replace(cfg, **overrides)


def retarget(cfg: SimConfig, run_cfg: dict, rows: list[dict]) -> SimConfig:
    """`cfg`'s calibrated rates with another run's coupling (mode, staleness bound, steps): what the
    model predicts for that run (cross-mode validation: calibrate from sync, predict async)."""
    return replace(cfg, mode="sync" if run_cfg["run"]["mode"] == "sync" else "async",
                   max_staleness=run_cfg["algorithm"]["max_staleness"], steps=len(rows))


def measured(rows: list[dict]) -> dict:
    """The same numbers SimResult has, from a real run's rows (window: first step to last step)."""
    a, b = rows[0], rows[-1]
    window = b["time"] - a["time"]
    lags: dict[int, int] = {}
    for r in rows:
        for k, v in r["lag_hist"].items():
            lags[int(k)] = lags.get(int(k), 0) + v
    num = max(sum(lags.values()), 1)
    return {"trained_tokens_per_s": sum(r["tokens"] for r in rows[1:]) / window, "window_s": window,
            "lag_mean": sum(k * v for k, v in lags.items()) / num, "lag_max": max(lags, default=0),
            "learner_idle_ratio": (b["idle_ratio"] * b["elapsed_s"] - a["idle_ratio"] * a["elapsed_s"]) / window}


# ---- the CLI -------------------------------------------------------------------------------------

FLEETS = (8, 32, 128, 512, 1024)


def sweep(base: SimConfig, fleets=FLEETS, modes=MODES, scale_batch: bool = True) -> list[dict]:
    """Every mode at every fleet size. With `scale_batch`, batch_groups and the learner's speed grow
    with the fleet (data-parallel learner), so the two stages stay as balanced as in `base`."""
    out = []
    for num in fleets:
        k = num / base.num_generators if scale_batch else 1
        for mode in modes:
            cfg = replace(base, mode=mode, num_generators=num,
                          batch_groups=max(1, round(base.batch_groups * k)),
                          learner_tokens_per_s=base.learner_tokens_per_s * k)
            r = simulate(cfg)
            out.append({"generators": num, "mode": mode, "batch_groups": cfg.batch_groups,
                        "tokens_per_s": r.trained_tokens_per_s, "lag_mean": r.lag_mean, "lag_max": r.lag_max,
                        "learner_idle": r.learner_idle_ratio, "generator_idle": r.generator_idle_ratio,
                        "dropped_stale": r.dropped_stale})
    return out


WIN_MARGIN = 0.05


def winner(rows: list[dict]) -> str:
    """The mode to pick at one fleet size: of those within WIN_MARGIN of the best throughput, the one
    with the lowest mean lag (staleness costs sample efficiency); ties go to sync < one_step_off < async."""
    top = max(r["tokens_per_s"] for r in rows)
    close = [r for r in rows if r["tokens_per_s"] >= (1 - WIN_MARGIN) * top]
    return min(close, key=lambda r: (round(r.get("lag_mean", 0.0), 6), MODES.index(r["mode"])))["mode"]


def _table(rows: list[dict]) -> str:
    lines = ["| generators | batch groups | mode | tokens/s | vs sync | lag mean/max | learner idle | gen idle | dropped |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    sync_tps = {r["generators"]: r["tokens_per_s"] for r in rows if r["mode"] == "sync"}
    best = {num: winner([r for r in rows if r["generators"] == num]) for num in {r["generators"] for r in rows}}
    for r in rows:
        vs = r["tokens_per_s"] / sync_tps[r["generators"]] if r["generators"] in sync_tps else float("nan")
        mark = " **wins**" if best[r["generators"]] == r["mode"] else ""
        lines.append(f"| {r['generators']} | {r['batch_groups']} | {r['mode']}{mark} | {r['tokens_per_s']:.1f} | "
                     f"{vs:.2f}x | {r['lag_mean']:.2f}/{r['lag_max']} | {r['learner_idle']:.2f} | "
                     f"{r['generator_idle']:.2f} | {r['dropped_stale']} |")
    return "\n".join(lines)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event model of the pipeline: throughput, lag, idle at scale")
    p.add_argument("--from-run", help="calibrate from a run directory (config.yaml + metrics.jsonl)")
    p.add_argument("--fleets", default=",".join(map(str, FLEETS)), help="generator counts to tabulate")
    p.add_argument("--modes", default=",".join(MODES), help="run modes to compare, comma-separated")
    p.add_argument("--no-scale-batch", action="store_true", help="keep batch_groups and learner speed fixed")
    p.add_argument("--validate", action="store_true", help="simulate the calibrated run itself and compare")
    p.add_argument("--against", help="with --validate: predict this other run (its run.mode, staleness and "
                   "steps) from --from-run's calibration, and compare with it (cross-mode validation)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("set", nargs="*", help="SimConfig overrides, e.g. len_sigma=1.0 sync_s=2 steps=20")
    p.set_defaults(fn=main)


def _overrides(items: list[str]) -> dict:
    types = {f: type(v) for f, v in asdict(SimConfig()).items()}
    out = {}
    for item in items:
        key, _, text = item.partition("=")
        if key not in types:
            raise SystemExit(f"asyncrl simulate: unknown parameter {key!r}; valid: {', '.join(types)}")
        out[key] = types[key](text)
    return out


def main(args: argparse.Namespace) -> int:
    overrides = _overrides(args.set)
    if args.from_run:
        run_cfg, rows = load_run(args.from_run)
        base = calibrate(run_cfg, rows, **overrides)
    else:
        base = replace(SimConfig(), **overrides)
    print("calibrated:" if args.from_run else "config:", json.dumps(asdict(base)))
    result: dict = {"base": asdict(base)}
    if args.validate:
        if not args.from_run:
            raise SystemExit("asyncrl simulate --validate needs --from-run RUN_DIR")
        target = base
        if args.against:  # the other run's coupling; every rate stays the calibrated one
            other_cfg, rows = load_run(args.against)
            target = retarget(base, other_cfg, rows)
        pred, real = simulate(target), measured(rows)
        result["validation"] = {"predicted": {k: getattr(pred, k) for k in real}, "measured": real,
                                "against": args.against or args.from_run, "mode": target.mode}
        for k, v in real.items():
            p = getattr(pred, k)
            err = (p - v) / v if v else float("nan")
            print(f"{k:22s} measured={v:10.3f} predicted={p:10.3f} error={err:+.1%}")
    fleets = [int(x) for x in args.fleets.split(",") if x]
    if fleets:
        rows_out = sweep(base, fleets, [m for m in args.modes.split(",") if m], not args.no_scale_batch)
        result["sweep"] = rows_out
        print(_table(rows_out))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0
