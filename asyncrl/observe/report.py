"""`asyncrl report RUN_DIR`: one page that says what a run did, for a person to read.

Reads the run folder only (complete rows, so a live run works too): `config.yaml` (what ran),
`metrics.jsonl` (one row per learner step), `eval.jsonl` (one row per held-out evaluation round) and
`eval_samples.jsonl` (the greedy answers to the first `eval.show` held-out questions, each round).
Writes a Markdown or HTML page with: the run's settings, wall time and steps; held-out greedy
accuracy (pass@1) before training, at its best and at the end, and when it first reached base + 5
and base + 10 points; a PNG of accuracy against wall time, beside the page; a few training numbers
early against late; and held-out questions with the answer before training and after, side by side.

Times are wall-clock seconds since the learner started (its first row's `time` less `elapsed_s`, as
`asyncrl plot --x time` counts them), or since the launch where the folder has a benchmark's
`launch.json` (`t_launch`). A round's time is when the weights it evaluated were current.
"""

from __future__ import annotations

import html
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.observe.metrics import complete_rows

GAINS = (5, 10)  # points of held-out accuracy over the base that the page times
DEFAULT_QUESTIONS = 5
SETTINGS = ("model.path", "data.task", "data.path", "reward.name", "run.mode", "run.max_steps", "algorithm.advantage",
            "algorithm.loss", "algorithm.max_staleness", "generator.num_generators", "generator.n",
            "generator.max_tokens", "generator.temperature", "learner.nproc", "learner.batch_groups", "learner.lr",
            "weights.sync_every", "eval.every", "eval.num_prompts", "eval.k")
# (row key, label, how the tenths are formatted); step_wall_s is computed from consecutive rows' `time`.
TRAINING = (("reward_mean", "reward mean", "{:.3f}"), ("step_wall_s", "wall seconds per step", "{:.2f}"),
            ("compute_s", "learner compute seconds per step", "{:.2f}"), ("idle_ratio", "learner idle", "{:.0%}"),
            ("gen_tokens_per_s", "generated tokens/s", "{:,.0f}"), ("lag_mean", "version lag (mean)", "{:.2f}"))


class ReportError(ValueError):
    """A run folder the page cannot be made from; the message says why and what to do."""


@dataclass
class RunFiles:
    """What the run folder holds, complete rows only."""

    run_dir: Path
    name: str
    config: dict
    metrics: list[dict]
    rounds: list[dict]  # complete evaluation rounds, one per version, oldest first
    samples: list[dict]
    t0: float  # the origin of every time on the page (wall clock)
    origin: str  # what t0 is, in words
    incomplete_rounds: int = 0


def _setting(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _read_config(run_dir: Path) -> dict:
    path = run_dir / "config.yaml"
    if not path.exists():
        return {}
    import yaml

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ReportError(f"{path} is not YAML: {str(e).splitlines()[0]}") from None
    return config if isinstance(config, dict) else {}


def _rows(path: Path) -> list[dict]:
    try:
        return complete_rows(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ReportError(f"{path} has a line that is not JSON ({e}): is it a run's file?") from None


def load_run(run_dir: str | Path) -> RunFiles:
    """The run folder's files; raises ReportError (one line) when there is nothing to report on."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder: pass a run folder ({{run.dir}}/{{run.name}}, e.g. runs/tiny)")
    metrics = _rows(run_dir / "metrics.jsonl")
    config = _read_config(run_dir)
    if not metrics and not (run_dir / "eval.jsonl").exists():
        what = "has no learner step yet" if config else "is not a run folder (no metrics.jsonl, eval.jsonl or config.yaml)"
        raise ReportError(f"{run_dir} {what}: pass a run folder ({{run.dir}}/{{run.name}}) once its learner has "
                          f"taken a step")
    evals = _rows(run_dir / "eval.jsonl")
    by_version = {r["eval/version"]: r for r in evals
                  if isinstance(r.get("eval/pass@1"), (int, float)) and isinstance(r.get("eval/version"), int)}
    rounds = [by_version[v] for v in sorted(by_version)]
    if not rounds:
        every = _setting(config, "eval.every")
        timed_out = sum(1 for r in evals if r.get("eval/incomplete"))
        if timed_out:
            why = f"{timed_out} round(s) timed out unfinished (eval.timeout_s); none finished"
        elif every == 0 or (every is None and not evals):
            why = "the run does not evaluate: set eval.every (e.g. eval.every=10) and run it again"
        else:
            why = "none has finished yet: the first (version 0) comes at the start, then one every eval.every steps"
        raise ReportError(f"{run_dir} has no held-out evaluation rounds: {why}")
    starts = [r["time"] - r.get("elapsed_s", 0.0) for r in metrics if isinstance(r.get("time"), (int, float))]
    starts += [r["eval/published_at"] for r in rounds if isinstance(r.get("eval/published_at"), (int, float))]
    t0, origin = (min(starts) if starts else 0.0), "the learner's start"
    if isinstance(t := _launch_time(run_dir), float):
        t0, origin = t, "the launch"
    samples = [r for r in _rows(run_dir / "eval_samples.jsonl")
               if isinstance(r.get("version"), int) and isinstance(r.get("prompt_id"), str)]
    return RunFiles(run_dir=run_dir, name=str(_setting(config, "run.name") or run_dir.name), config=config,
                    metrics=metrics, rounds=rounds, samples=samples, t0=t0, origin=origin,
                    incomplete_rounds=sum(1 for r in evals if r.get("eval/incomplete")))


def _launch_time(run_dir: Path) -> float | None:
    """`t_launch` of a benchmark's `launch.json` beside the run's files (benchmarks/smollm2_curve.py)."""
    path = run_dir / "launch.json"
    try:
        t = json.loads(path.read_text()).get("t_launch") if path.exists() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ReportError(f"{path} is not a launch record ({e})") from None
    return float(t) if isinstance(t, (int, float)) else None


# ---- the numbers -------------------------------------------------------------------------------------


@dataclass
class Point:
    version: int
    step: int
    t_s: float  # seconds since the origin when the evaluated weights were current
    pass_at_1: float


def eval_points(run: RunFiles) -> list[Point]:
    return [Point(version=int(r["eval/version"]), step=int(r.get("step", 0)),
                  t_s=float(r.get("eval/published_at", run.t0)) - run.t0, pass_at_1=float(r["eval/pass@1"]))
            for r in run.rounds]


def time_to_gain(points: list[Point], points_gained: float) -> Point | None:
    """The first round after the base (the first round) at least `points_gained` points above it."""
    base = points[0].pass_at_1
    return next((p for p in points[1:] if p.pass_at_1 >= base + points_gained / 100 - 1e-9), None)


def wall_seconds(run: RunFiles) -> float:
    """From the origin to the last thing the folder records: a step's row or a round's last result."""
    ends = [r["time"] for r in run.metrics if isinstance(r.get("time"), (int, float))]
    ends += [r["eval/published_at"] + r.get("eval/seconds", 0.0) for r in run.rounds if "eval/published_at" in r]
    return max(ends, default=run.t0) - run.t0


def _with_step_wall(rows: list[dict]) -> list[dict]:
    """Each row with `step_wall_s`, the wall seconds since the row before (the first row has none)."""
    out = [dict(rows[0])] if rows else []
    for a, b in zip(rows, rows[1:], strict=False):
        out.append({**b, "step_wall_s": b["time"] - a["time"]} if "time" in a and "time" in b else dict(b))
    return out


def _idle_between(a: dict | None, b: dict) -> float | None:
    """The learner's idle share between two rows (`idle_ratio` counts from the learner's start)."""
    if "idle_ratio" not in b or "elapsed_s" not in b:
        return None
    if a is None:
        return b["idle_ratio"]
    span = b["elapsed_s"] - a["elapsed_s"]
    return (b["idle_ratio"] * b["elapsed_s"] - a["idle_ratio"] * a["elapsed_s"]) / span if span > 0 else None


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return sum(vals) / len(vals) if vals else None


def _steps(rows: list[dict]) -> str:
    a, b = rows[0].get("step"), rows[-1].get("step")
    return f"step {a}" if a == b else f"steps {a}-{b}"


def training_table(metrics: list[dict]) -> list[tuple[str, str, str, str]]:
    """(label, first tenth, last tenth, whole run) for each training number the run logged, and a
    header row of the step ranges."""
    rows = _with_step_wall(metrics)
    if not rows:
        return []
    tenth = max(len(rows) // 10, 1)
    first, last = rows[:tenth], rows[-tenth:]
    before_last = rows[-tenth - 1] if len(rows) > tenth else None
    table = [("", _steps(first), _steps(last), "whole run")]
    for key, label, fmt in TRAINING:
        if key == "idle_ratio":
            vals = (_idle_between(None, first[-1]), _idle_between(before_last, last[-1]),
                    _idle_between(None, rows[-1]))
        else:
            vals = (_mean(first, key), _mean(last, key), _mean(rows, key))
        if any(v is not None for v in vals):
            table.append((label, *("-" if v is None else fmt.format(v) for v in vals)))
    return table


@dataclass
class Answer:
    version: int
    text: str
    correct: bool
    reward: float


@dataclass
class Question:
    index: int
    prompt_id: str
    prompt: str
    reference: str
    before: Answer
    after: Answer | None = None


@dataclass
class Answers:
    before_version: int | None = None
    after_version: int | None = None
    questions: list[Question] = field(default_factory=list)
    flips: tuple[int, int] = (0, 0)  # of the questions kept in both rounds: wrong -> right, right -> wrong


def _answer(row: dict) -> Answer:
    return Answer(version=int(row["version"]), text=str(row.get("completion", "")), correct=bool(row.get("correct")),
                  reward=float(row.get("reward", 0.0)))


def pair_answers(samples: list[dict], num: int) -> Answers:
    """The first `num` kept questions with their answer in the first round (before training) and the
    last; flips are counted over every question kept in both."""
    versions = sorted({int(r["version"]) for r in samples if "version" in r})
    if not versions:
        return Answers()
    before_v, after_v = versions[0], (versions[-1] if len(versions) > 1 else None)
    before = {r["prompt_id"]: r for r in samples if r.get("version") == before_v}
    after = {r["prompt_id"]: r for r in samples if r.get("version") == after_v}
    questions = []
    for pid, row in sorted(before.items(), key=lambda kv: kv[1].get("index", 0)):
        if after_v is not None and pid not in after:
            continue
        questions.append(Question(index=int(row.get("index", 0)), prompt_id=pid, prompt=str(row.get("prompt", "")),
                                  reference=str(row.get("answer", "")), before=_answer(row),
                                  after=_answer(after[pid]) if after_v is not None else None))
    both = [q for q in questions if q.after is not None]
    flips = (sum(not q.before.correct and q.after.correct for q in both),
             sum(q.before.correct and not q.after.correct for q in both))
    return Answers(before_v, after_v, questions[:num], flips)


# ---- the page ----------------------------------------------------------------------------------------

MAX_ANSWER_CHARS = 4000  # of one answer on the page; eval_samples.jsonl keeps it whole


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _minutes(t_s: float) -> str:
    return f"{t_s / 60:.1f} min"


def headline(run: RunFiles) -> list[tuple[str, str]]:
    """(what, value): the run's size, and its held-out accuracy before training, at best, at the end."""
    points = eval_points(run)
    base, final = points[0], points[-1]
    best = max(points, key=lambda p: (p.pass_at_1, -p.version))
    last = run.metrics[-1] if run.metrics else {}
    num_prompts = run.rounds[-1].get("eval/num_prompts", "?")
    base_name = "before training (version 0)" if base.version == 0 else f"first round (version {base.version})"
    rows = [("run", run.name), ("run folder", str(run.run_dir)),
            ("steps", f"{last.get('step', 0)} (policy version {last.get('version', '?')})"),
            ("wall time", f"{_minutes(wall_seconds(run))} since {run.origin}"),
            ("held-out set", f"{num_prompts} questions, greedy answers (pass@1), {len(points)} rounds"),
            (f"accuracy {base_name}", _pct(base.pass_at_1)),
            ("best accuracy", f"{_pct(best.pass_at_1)} (version {best.version}, at {_minutes(best.t_s)})"),
            ("final accuracy", f"{_pct(final.pass_at_1)} (version {final.version}, at {_minutes(final.t_s)}; "
                               f"{100 * (final.pass_at_1 - base.pass_at_1):+.1f} points)")]
    for gain in GAINS:
        hit = time_to_gain(points, gain)
        rows.append((f"time to base + {gain} points ({_pct(base.pass_at_1 + gain / 100)})",
                     "not reached" if hit is None else
                     f"{_minutes(hit.t_s)} (version {hit.version}, step {hit.step}: {_pct(hit.pass_at_1)})"))
    if run.incomplete_rounds:
        rows.append(("rounds timed out", f"{run.incomplete_rounds} (eval.timeout_s; left out)"))
    return rows


def settings(run: RunFiles) -> list[tuple[str, str]]:
    return [(key, str(v)) for key in SETTINGS if (v := _setting(run.config, key)) not in (None, "")]


def _clip(text: str) -> str:
    if len(text) <= MAX_ANSWER_CHARS:
        return text
    return text[:MAX_ANSWER_CHARS] + f" ... ({len(text) - MAX_ANSWER_CHARS} more characters in eval_samples.jsonl)"


def _verdict(a: Answer | None, when: str) -> str:
    if a is None:
        return f"{when}: no round yet"
    return f"{when} (version {a.version}): {'✓ right' if a.correct else '✗ wrong'} (reward {a.reward:g})"


def answers_note(answers: Answers) -> str:
    if answers.before_version is None:
        return ("No answers were kept: the run had eval.show=0, or was made by a version of asyncrl before "
                "eval.show. Set eval.show=N to keep the greedy answers to the first N held-out questions.")
    if answers.after_version is None:
        return (f"Only one round (version {answers.before_version}) has kept answers so far; the answers after "
                f"training come with the next round.")
    up, down = answers.flips
    return (f"The first held-out questions (eval.show), in order, not chosen: each with its greedy answer in the "
            f"first round (version {answers.before_version}) and the last (version {answers.after_version}). Of "
            f"all the questions kept in both, {up} went from wrong to right and {down} from right to wrong.")


# Markdown: backslash-escape what inline Markdown (GitHub's included: `$` math, `~` strike-through)
# would read; newlines become <br>, so a text is one line of its table cell or paragraph. A paragraph
# (`block`) also escapes what would open a block at its start (a heading, list, quote, rule).
_MD_INLINE = re.compile(r"([\\`*_\[\]<>&|~$])")
_MD_BLOCK_START = re.compile(r"^(\s*)(?:([#+\-=])|(\d+)([.)]))")


def md_text(text: str, block: bool = False) -> str:
    if block:  # four spaces would open a code block
        text = text.lstrip()
    joined = "<br>".join(_MD_INLINE.sub(r"\\\1", line) for line in text.split("\n"))
    if block:
        joined = _MD_BLOCK_START.sub(lambda m: f"{m[1]}\\{m[2]}" if m[2] else f"{m[1]}{m[3]}\\{m[4]}", joined)
    return joined if joined.strip() else "*(empty)*"


def _md_table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> list[str]:
    out = ["| " + " | ".join(md_text(h) if h else " " for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(md_text(c) for c in row) + " |" for row in rows]
    return out + [""]


def render_markdown(run: RunFiles, answers: Answers, png_name: str) -> str:
    lines = [f"# Run {md_text(run.name)}", "", *_md_table(headline(run), ("", "")),
             "## Held-out accuracy against wall time", "", f"![held-out accuracy]({png_name})", ""]
    if rows := settings(run):
        lines += ["## Settings", "", *_md_table(rows, ("setting", "value"))]
    if table := training_table(run.metrics):
        lines += ["## Training, early against late", "", *_md_table(table[1:], ("", *table[0][1:]))]
    lines += ["## Answers before and after training", "", md_text(answers_note(answers), block=True), ""]
    for q in answers.questions:
        lines += [f"### Question {q.index + 1} ({md_text(q.prompt_id)})", "", f"> {md_text(q.prompt, block=True)}", "",
                  f"Reference answer: **{md_text(q.reference)}**", "",
                  *_md_table([(_clip(q.before.text), _clip(q.after.text) if q.after else "")],
                             (_verdict(q.before, "before"), _verdict(q.after, "after")))]
    return "\n".join(lines)


_CSS = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.3em .6em;"
        "vertical-align:top;text-align:left}pre{white-space:pre-wrap;margin:0;font-size:.9em}"
        ".qa td{width:50%}.right{color:#176117}.wrong{color:#a11}img{max-width:100%}")


def _html_table(rows: list[tuple[str, ...]], header: tuple[str, ...] | None = None) -> str:
    e = html.escape
    head = "<tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _html_question(q: Question) -> str:
    e = html.escape
    cells = [(q.before, "before"), (q.after, "after")]
    head = "".join(f"<th class=\"{'right' if a and a.correct else 'wrong'}\">{e(_verdict(a, w))}</th>"
                   for a, w in cells)
    body = "".join(f"<td><pre>{e(_clip(a.text)) if a else ''}</pre></td>" for a, _ in cells)
    return (f"<h3>Question {q.index + 1} ({e(q.prompt_id)})</h3><blockquote><pre>{e(q.prompt)}</pre></blockquote>"
            f"<p>Reference answer: <b>{e(q.reference)}</b></p><table class=\"qa\"><tr>{head}</tr><tr>{body}</tr></table>")


def render_html(run: RunFiles, answers: Answers, png_name: str) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset=\"utf-8\"><title>Run {e(run.name)}</title>"
             f"<style>{_CSS}</style></head><body><h1>Run {e(run.name)}</h1>", _html_table(headline(run)),
             f"<h2>Held-out accuracy against wall time</h2><img src=\"{e(png_name)}\" alt=\"held-out accuracy\">"]
    if rows := settings(run):
        parts += ["<h2>Settings</h2>", _html_table(rows, ("setting", "value"))]
    if table := training_table(run.metrics):
        parts += ["<h2>Training, early against late</h2>", _html_table(table[1:], table[0])]
    parts += ["<h2>Answers before and after training</h2>", f"<p>{e(answers_note(answers))}</p>",
              *(_html_question(q) for q in answers.questions), "</body></html>"]
    return "\n".join(parts) + "\n"


def plot_accuracy(run: RunFiles, path: Path) -> Path:
    from asyncrl.observe.plot import plot_eval_curves

    curves = {"pass@1 (greedy)": [(p.t_s / 60, p.pass_at_1) for p in eval_points(run)]}
    mean_k = [(float(r.get("eval/published_at", run.t0)) - run.t0, r["eval/mean@k"]) for r in run.rounds
              if isinstance(r.get("eval/mean@k"), (int, float))]
    if mean_k:
        curves[f"mean@{run.rounds[-1].get('eval/k', 'k')} (sampled)"] = [(t / 60, y) for t, y in mean_k]
    title = run.name.replace("$", r"\$") + ": held-out accuracy"  # a `$` would start matplotlib's math text
    return plot_eval_curves(curves, path, title=title, xlabel=f"wall time (minutes since {run.origin})",
                            ylabel="held-out accuracy")


def write_report(run_dir: str | Path, out: str | Path | None = None,
                 num_questions: int = DEFAULT_QUESTIONS) -> tuple[Path, Path]:
    """Writes the page (Markdown, or HTML when `out` ends in .html) and its PNG beside it
    (`{stem}_accuracy.png`); returns both paths. Default: `{run_dir}/report.md`."""
    if num_questions < 0:
        raise ReportError(f"--questions must be 0 or more, got {num_questions}")
    page = Path(out) if out else Path(run_dir) / "report.md"
    if page.suffix.lower() not in (".md", ".html", ".htm"):
        raise ReportError(f"--out {page}: the page is Markdown or HTML, so its name ends in .md or .html")
    run = load_run(run_dir)
    answers = pair_answers(run.samples, num_questions)
    page.parent.mkdir(parents=True, exist_ok=True)
    png = plot_accuracy(run, page.with_name(f"{page.stem}_accuracy.png"))
    render = render_markdown if page.suffix.lower() == ".md" else render_html
    page.write_text(render(run, answers, png.name))
    return page, png
