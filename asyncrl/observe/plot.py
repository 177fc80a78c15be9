"""`asyncrl plot RUN_DIR`: the pictures a person checks first when training misbehaves.

Reads `{run_dir}/metrics.jsonl` (one row per learner step) and writes PNGs (matplotlib, Agg) to
`{run_dir}/plots/`: reward mean and distribution, KL and entropy (when the run logged them),
version lag (histogram and over time), throughput per role, weight-sync time, and held-out accuracy
when the run had evaluation rounds. `--x time` puts wall-clock minutes on the x axis instead of steps.
"""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.observe.metrics import complete_rows

log = logging.getLogger(__name__)


def load_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: pass the run directory ({{run.dir}}/{{run.name}})")
    rows = complete_rows(path)
    if not rows:
        raise ValueError(f"{path} has no rows yet: wait for the first learner step")
    return rows


def _series(rows: list[dict], key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, value) of every row that has `key`; x is "step" or "time" (minutes since the first row)."""
    t0 = min((r["time"] - r.get("elapsed_s", 0.0) for r in rows if "time" in r), default=0.0)
    pts = [((r["time"] - t0) / 60 if x == "time" else r["step"], r[key]) for r in rows
           if isinstance(r.get(key), (int, float)) and (x != "time" or "time" in r)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_eval_curves(curves: dict[str, list[tuple[float, float]]], path: str | Path, title: str = "",
                     xlabel: str = "wall time (minutes)",
                     ylabel: str = "held-out greedy accuracy (pass@1)") -> Path:
    """Held-out curves of a share (greedy accuracy by default), one line per run: {label: [(x, y), ...]}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in curves.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=label)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title or "evaluation", ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _reward_figure(plt, rows: list[dict], x: str, xlabel: str):
    """The mean and the spread of each batch (quantile bands)."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps, mean = _series(rows, "reward_mean", x)
    ax.plot(steps, mean, label="mean", color="C0")
    for lo, hi, alpha in (("reward_p10", "reward_p90", 0.15), ("reward_p25", "reward_p75", 0.3)):
        s_lo, v_lo = _series(rows, lo, x)
        s_hi, v_hi = _series(rows, hi, x)
        if v_lo and len(v_lo) == len(v_hi):
            ax.fill_between(s_lo, v_lo, v_hi, alpha=alpha, color="C0", label=f"{lo[-3:]}-{hi[-3:]}")
    s_max, v_max = _series(rows, "reward_max", x)
    if v_max:
        ax.plot(s_max, v_max, ":", color="C1", label="max")
    ax.set(xlabel=xlabel, ylabel="reward", title="reward per batch")
    ax.legend(loc="best")
    return fig


def _reward_distribution_figure(plt, rows: list[dict]):
    """The batch quantiles of every step, early vs late halves; None when the run logged none."""
    if not any("reward_p50" in r for r in rows):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    half = max(len(rows) // 2, 1)
    for part, label in ((rows[:half], "first half"), (rows[half:], "second half")):
        vals = [r[k] for r in part for k in ("reward_p10", "reward_p25", "reward_p50", "reward_p75", "reward_p90")
                if k in r]
        if vals:
            ax.hist(vals, bins=20, alpha=0.5, label=label)
    ax.set(xlabel="reward (batch quantiles)", ylabel="count", title="reward distribution")
    ax.legend(loc="best")
    return fig


def _single_series_figure(plt, rows: list[dict], key: str, x: str, xlabel: str, run_dir: Path):
    """One logged value over the run (kl, entropy); None (logged) when the run did not log it."""
    steps, vals = _series(rows, key, x)
    if not vals:
        log.info("no %r in %s/metrics.jsonl: %s.png skipped", key, run_dir, key)
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(steps, vals)
    ax.set(xlabel=xlabel, ylabel=key, title=key)
    return fig


def _lag_figure(plt, rows: list[dict], x: str, xlabel: str):
    """Version lag: histogram over all trained tokens, and mean/max over time."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    hist: dict[int, int] = {}
    for r in rows:
        for lag, count in r.get("lag_hist", {}).items():
            hist[int(lag)] = hist.get(int(lag), 0) + int(count)
    if hist:
        a1.bar(list(hist), list(hist.values()))
        a1.set_xticks(sorted(hist))
    a1.set(xlabel="version lag", ylabel="tokens", title="version lag of trained tokens")
    for key, style in (("lag_mean", "-"), ("lag_max", "--"), ("staleness_bound", ":")):
        steps, vals = _series(rows, key, x)
        a2.plot(steps, vals, style, label=key)
    a2.set(xlabel=xlabel, ylabel="versions", title="version lag over time")
    a2.legend(loc="best")
    return fig


def _plot_lines(ax, rows: list[dict], labels: tuple[tuple[str, str], ...], x: str, **style) -> None:
    """One line per (key, label) the run logged."""
    for key, label in labels:
        steps, vals = _series(rows, key, x)
        if vals:
            ax.plot(steps, vals, label=label, **style)


def _throughput_figure(plt, rows: list[dict], x: str, xlabel: str):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _plot_lines(ax, rows, (("gen_tokens_per_s", "generators (tokens/s)"),
                           ("learner_tokens_per_s", "learner (tokens/s)")), x)
    ax.set(xlabel=xlabel, ylabel="tokens/s", title="throughput per role")
    ax.legend(loc="best")
    return fig


def _sync_figure(plt, rows: list[dict], x: str, xlabel: str):
    """Where the learner's time goes (a step's compute, waiting for data, the push on its critical
    path, of which waiting for the previous push) and idle ratios."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    _plot_lines(a1, rows, (("compute_s", "compute"), ("data_wait_s", "waiting for data"), ("sync_s", "push"),
                           ("push_wait_s", "waiting for the previous push")), x, marker=".")
    a1.set(xlabel=xlabel, ylabel="seconds", title="learner time per step")
    a1.legend(loc="best")
    _plot_lines(a2, rows, (("idle_ratio", "learner idle"), ("gen_idle_ratio_mean", "generators idle")), x)
    a2.set(xlabel=xlabel, ylabel="fraction", title="idle ratios", ylim=(0, 1))
    a2.legend(loc="best")
    return fig


def _eval_figure(plt, rows: list[dict], x: str, xlabel: str):
    """Held-out accuracy of the evaluation rounds (eval.every > 0); None when the run had none."""
    if not any("eval/pass@1" in r for r in rows):
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = ("eval/pass@1", "eval/mean@k", "eval/pass@k")
    _plot_lines(ax, rows, tuple((k, k.removeprefix("eval/")) for k in keys), x, marker=".")
    ax.set(xlabel=xlabel, ylabel="held-out accuracy", title="evaluation", ylim=(0, 1))
    ax.legend(loc="best")
    return fig


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, x: str = "step") -> list[Path]:
    """The run's PNGs; x is "step" or "time" (wall-clock minutes since the learner started)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    xlabel = "minutes" if x == "time" else "step"
    figures = [
        ("reward.png", lambda: _reward_figure(plt, rows, x, xlabel)),
        ("reward_distribution.png", lambda: _reward_distribution_figure(plt, rows)),
        ("kl.png", lambda: _single_series_figure(plt, rows, "kl", x, xlabel, run_dir)),
        ("entropy.png", lambda: _single_series_figure(plt, rows, "entropy", x, xlabel, run_dir)),
        ("lag.png", lambda: _lag_figure(plt, rows, x, xlabel)),
        ("throughput.png", lambda: _throughput_figure(plt, rows, x, xlabel)),
        ("sync.png", lambda: _sync_figure(plt, rows, x, xlabel)),
        ("eval.png", lambda: _eval_figure(plt, rows, x, xlabel)),
    ]
    written = []
    for name, draw in figures:
        fig = draw()
        if fig is None:
            continue
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
