"""One logging interface for every step's metrics, with jsonl, wandb and TensorBoard backends.

Learner rank 0 is the only writer, so a run is one wandb run and one TensorBoard log no matter how
many processes it has: each step it also reads the fleet's numbers (`gen:*` heartbeats, the buffer's
`metrics` hash) and logs them beside its own (`gen/{id}/...`, `buffer/...`).
`metrics.jsonl` is always written (`asyncrl plot` and the tests read it); `logging.backends` adds
wandb (offline by default, files under `{run_dir}/wandb`) and TensorBoard (`{run_dir}/tensorboard`).
Backends import their libraries only when selected.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import Config, to_dict

if TYPE_CHECKING:
    from asyncrl.protocol.schema import Heartbeat

log = logging.getLogger(__name__)


def scalars(row: dict) -> dict[str, float]:
    """The row's plain numbers (nested dicts such as `lag_hist` and lists are left to the backends)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def complete_rows(path: Path | str) -> list[dict]:
    """The rows of a JSON-lines file another process may be appending to (a run's `metrics.jsonl`): a
    last line without its newline is a row still being written, left for the next read. No file: no rows."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line.strip()]


class JsonlBackend:
    """`metrics.jsonl`, one row per step. A learner that resumed a checkpoint trains the steps after it
    again: its first row of step `s` supersedes the rows of step `s` and later that an earlier
    learner wrote, which move to `metrics.rolled_back.jsonl` (kept, not lost), so the file holds
    each step once, the row of the weights the run went on from."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._first = True

    def log(self, step: int, row: dict) -> None:
        if self._first:
            self._first = False
            supersede_rows(self.path, step)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        pass


def supersede_rows(path: Path, step: int) -> int:
    """Moves the rows of `path` whose step is `step` or later to `{stem}.rolled_back.jsonl` beside it
    (appended) and rewrites `path` without them, atomically; returns how many moved. A last line
    cut short (a learner killed mid-write) is dropped too, so that the next row starts a line."""
    rows = complete_rows(path)
    stale = [r for r in rows if int(r.get("step", 0)) >= step]
    if not stale:
        if path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
            _rewrite(path, rows)
        return 0
    keep = [r for r in rows if int(r.get("step", 0)) < step]
    with open(path.with_name(f"{path.stem}.rolled_back.jsonl"), "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in stale)
    _rewrite(path, keep)
    log.info("%s: %d rows of steps %d-%d written before the resume moved to %s.rolled_back.jsonl (trained again)",
             path.name, len(stale), step, max(int(r.get("step", 0)) for r in stale), path.stem)
    return len(stale)


def _rewrite(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


class WandbBackend:
    def __init__(self, cfg: Config, run_dir: Path):
        # Offline needs no network and no account: the run is written under {run_dir}/wandb and can be
        # uploaded later with `wandb sync`.
        os.environ.setdefault("WANDB_MODE", cfg.logging.wandb_mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=cfg.logging.wandb_project, name=cfg.run.name, dir=str(run_dir),
                              mode=cfg.logging.wandb_mode, config=to_dict(cfg))

    def log(self, step: int, row: dict) -> None:
        data: dict = scalars(row)
        hist = row.get("lag_hist")
        if hist:
            import numpy as np

            lags = np.repeat([int(k) for k in hist], [int(v) for v in hist.values()])
            data["lag_hist"] = self.wandb.Histogram(lags, num_bins=max(int(lags.max()) + 1, 1))
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorboardBackend:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, row: dict) -> None:
        for key, value in scalars(row).items():
            self.writer.add_scalar(key, value, step)
        hist = row.get("lag_hist")
        if hist:
            lags = sorted(int(k) for k in hist)
            counts = [float(hist[str(k)]) for k in lags]
            n = sum(counts)
            self.writer.add_histogram_raw(
                "lag_hist", min=float(lags[0]), max=float(lags[-1]), num=n,
                sum=float(sum(k * c for k, c in zip(lags, counts, strict=True))),
                sum_squares=float(sum(k * k * c for k, c in zip(lags, counts, strict=True))),
                bucket_limits=[k + 0.5 for k in lags], bucket_counts=counts, global_step=step)
        # A person watching TensorBoard (or a test reading the files) sees every step at once.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsLogger:
    """`log(step, row)` to every selected backend; `close()` once at the end (also run at exit)."""

    def __init__(self, cfg: Config, run_dir: Path | None = None):
        run_dir = Path(run_dir or cfg.run_dir)
        self.backends: list = [JsonlBackend(run_dir / "metrics.jsonl")]
        for name in dict.fromkeys(cfg.logging.backends):
            if name == "wandb":
                self.backends.append(WandbBackend(cfg, run_dir))
            elif name == "tensorboard":
                self.backends.append(TensorboardBackend(run_dir))
        self._closed = False
        atexit.register(self.close)

    def log(self, step: int, row: dict) -> None:
        for backend in self.backends:
            backend.log(step, row)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for backend in self.backends:
            try:
                backend.close()
            except Exception as e:  # one backend failing to flush must not lose the others
                log.error("closing metrics backend %s failed: %r", type(backend).__name__, e)


# ---- fleet numbers read from Redis --------------------------------------------------------------


def _num(value: bytes) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def oldest_undelivered_age_s(client, keys) -> float:
    """Age of the oldest trajectory group not yet read by the learner (0 when none is waiting)."""
    from asyncrl.protocol.keys import LEARNER_GROUP

    last = b"0-0"
    try:
        for info in client.xinfo_groups(keys.trajectories):
            if info["name"] in (LEARNER_GROUP, LEARNER_GROUP.encode()):
                last = info["last-delivered-id"]
    except Exception as e:  # the stream does not exist yet
        if "no such key" not in str(e).lower():
            raise
        return 0.0
    last = last.decode() if isinstance(last, bytes) else last
    entries = client.xrange(keys.trajectories, min=f"({last}", count=1)
    if not entries:
        return 0.0
    ms = int(entries[0][0].split(b"-")[0])
    return max(time.time() - ms / 1000.0, 0.0)


def fleet_metrics(client, keys, fleet: dict[str, Heartbeat] | None = None) -> dict[str, float]:
    """`gen/{id}/{field}` for every live generator and `buffer/{field}` from the buffer's hash.
    `fleet`: a heartbeat snapshot the caller already read (asyncrl/protocol/fleet.py); read here when None."""
    from asyncrl.protocol.fleet import read_fleet

    fleet = read_fleet(client, keys) if fleet is None else fleet
    row: dict[str, float] = {}
    for gid, hb in sorted(fleet.items()):
        for field in ("version", "tokens_per_s", "idle_ratio", "idle_s", "tokens", "groups", "sync_s_total"):
            row[f"gen/{gid}/{field}"] = float(getattr(hb, field))
    idle = [hb.idle_ratio for hb in fleet.values()]
    row["gen_idle_ratio_mean"] = sum(idle) / len(idle) if idle else 0.0
    for k, v in client.hgetall(keys.metrics).items():
        name = k.decode()
        if name.startswith("buffer:") and (x := _num(v)) is not None:
            row["buffer/" + name.split(":", 1)[1].replace(":", "_")] = x
    row["buffer_oldest_age_s"] = oldest_undelivered_age_s(client, keys)
    return row


class WindowRate:
    """A quantity per second over the last `window_s` seconds of wall time, from amounts added as they
    happen. The left edge is the newest sample at least `window_s` old, so the window spans it whole:
    one short step or one burst of finished groups does not read as a spike."""

    def __init__(self, start: float, window_s: float = 30.0):
        from collections import deque

        self.window_s = window_s
        self.total = 0.0
        self.history = deque([(start, 0.0)])  # (monotonic time, total)

    def add(self, amount: float, now: float) -> float:
        """Adds `amount` at `now` (monotonic seconds); returns the rate over the window ending there."""
        self.total += amount
        self.history.append((now, self.total))
        while len(self.history) > 2 and self.history[1][0] <= now - self.window_s:
            self.history.popleft()
        t0, total0 = self.history[0]
        return (self.total - total0) / (now - t0) if now > t0 else 0.0


class FleetTokenRate:
    """Generated tokens per second of the whole fleet over the last `window_s` seconds of wall time,
    from the cumulative `tokens` counters the generators publish in their heartbeats.

    Why not the sum of the heartbeats' `tokens_per_s`: that is each generator's rate over its last
    heartbeat interval (1 s), and its counter moves only when a whole group finishes, so when groups
    take longer than that (a real model on CPU, long completions) nearly every interval has no group
    finishing and the sum read 0.0 at every step. A generator first seen, or whose counter went
    down (it restarted), is taken to have started after the previous update: its tokens count from 0.
    """

    def __init__(self, start: float, window_s: float = 30.0):
        self.window = WindowRate(start, window_s)
        self.counters: dict[str, float] = {}  # the last counter seen per generator (gone ones kept)

    def update(self, counters: dict[str, float], now: float) -> float:
        """Tokens per second over the window ending at `now` (monotonic seconds)."""
        new = 0.0
        for gid, tokens in counters.items():
            prev = self.counters.get(gid, 0.0)
            new += tokens - prev if tokens >= prev else tokens
            self.counters[gid] = tokens
        return self.window.add(new, now)


def reward_stats(rewards: list[float]) -> dict[str, float]:
    """Mean, spread and quantiles of one batch's rewards: the reward distribution over time."""
    import numpy as np

    r = np.asarray(rewards, dtype=float)
    q = np.quantile(r, [0.1, 0.25, 0.5, 0.75, 0.9])
    return {"reward_min": float(r.min()), "reward_std": float(r.std()),
            **{f"reward_p{p}": float(v) for p, v in zip((10, 25, 50, 75, 90), q, strict=True)}}


class LearnerObservability:
    """What learner rank 0 does with each step's row: enrich, log, export, publish for `status`."""

    def __init__(self, cfg: Config, client, keys):
        from asyncrl.observe.exporter import start_exporter

        self.cfg, self.client, self.keys = cfg, client, keys
        self.logger = MetricsLogger(cfg)
        self.exporter = start_exporter(cfg, "learner", client=client, keys=keys)
        self.groups_trained = 0

    def on_step(self, row: dict, rewards: list[float], fleet: dict[str, Heartbeat] | None = None) -> None:
        """`fleet`: the step's heartbeat snapshot (asyncrl/protocol/fleet.py), read here when None."""
        self.groups_trained += int(row.get("num_groups", 0))
        dropped = int(row.get("dropped_stale", 0))
        row.update(reward_stats(rewards))
        row["dropped_frac"] = dropped / max(dropped + self.groups_trained, 1)
        row.setdefault("masked_frac", 0.0)  # the decoupled-PPO loss masks no token
        row.update(fleet_metrics(self.client, self.keys, fleet))
        # /metrics and the lag history first, the files last: whoever has read a step's jsonl row then
        # finds that step everywhere else too (a scrape between the two read the step before: CI's
        # observed-run test).
        if self.exporter is not None:
            self.exporter.update(row)
            self.exporter.observe_lags(row.get("lag_hist", {}))
        entry = json.dumps({"step": row["step"], "version": row["version"], "t": row.get("time", time.time()),
                            "lag_hist": row.get("lag_hist", {})})
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(self.keys.lag_history, entry)
        pipe.ltrim(self.keys.lag_history, 0, max(self.cfg.logging.lag_history, 1) - 1)
        pipe.execute()
        self.logger.log(int(row["step"]), row)
        if row["step"] >= self.cfg.run.max_steps:
            self.logger.close()  # flush wandb / TensorBoard while the process is still healthy
