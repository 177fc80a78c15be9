"""`asyncrl status`: a live view of the fleet read from Redis, or one JSON snapshot (`--once --json`).

Everything shown comes from the run's keys: `gen:*` heartbeats, the `learner` and `metrics` hashes,
the `lag_history` list the learner appends per batch, the `events` stream, the `exporters` hash,
plus the liveness watchdog's verdict (asyncrl/observe/watchdog.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from asyncrl.config import Config
from asyncrl.observe import timeline
from asyncrl.protocol.keys import Keys, connect


def _dec(d: dict) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in d.items()}


def _num(value, default=None):
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def snapshot(client, keys: Keys, cfg: Config, watchdog=None, last_n: int = 20, num_events: int = 15) -> dict:
    from asyncrl.observe.metrics import oldest_undelivered_age_s
    from asyncrl.protocol.fleet import read_fleet
    from asyncrl.protocol.keys import PROMPT_GROUP
    from asyncrl.protocol.store import group_lag

    now = time.time()
    exporters = _dec(client.hgetall(keys.exporters))
    gens = []
    for gid, hb in sorted(read_fleet(client, keys).items()):
        gens.append({"id": gid, "state": hb.state, "version": hb.version, "tokens_per_s": hb.tokens_per_s,
                     "idle_ratio": hb.idle_ratio, "groups": hb.groups,
                     "heartbeat_age_s": now - (hb.updated_at or now), "pid": hb.pid, "host": hb.host,
                     "metrics_url": exporters.get(f"generator:{gid}"),
                     "_stall": {"stall": hb.stall, "stall_what": hb.stall_what, "stall_since": str(hb.stall_since)}})
    lh = _dec(client.hgetall(keys.learner))
    learner = _learner(client, keys, lh, exporters, now)
    bm = {k.split(":", 1)[1]: v for k, v in _dec(client.hgetall(keys.metrics)).items() if k.startswith("buffer:")}
    try:
        depth = group_lag(client, keys.trajectories, "learner")
        backlog = group_lag(client, keys.prompts, PROMPT_GROUP)
    except Exception as e:  # the streams do not exist before the buffer's set-up
        if "no such key" not in str(e).lower():
            raise
        depth = backlog = 0
    cursor = _dec(client.hgetall(keys.cursor))
    buffer = {"depth": depth, "oldest_age_s": oldest_undelivered_age_s(client, keys), "prompt_backlog": backlog,
              "released": int(_num(cursor.get("released"), 0)), "groups": int(_num(bm.get("groups"), 0)),
              "groups_per_s": _num(bm.get("groups_per_s"), 0.0),
              "auth_refused": int(_num(bm.get("auth_refused"), 0)),
              "rejected": {k[7:]: int(_num(v, 0)) for k, v in sorted(bm.items()) if k.startswith("reject:")},
              "updated_age_s": now - _num(bm["updated_at"]) if "updated_at" in bm else None,
              "metrics_url": exporters.get("buffer")}
    batches = [json.loads(x) for x in client.lrange(keys.lag_history, 0, max(last_n, 1) - 1)]
    hist: dict[str, int] = {}
    for b in batches:
        for lag, count in b.get("lag_hist", {}).items():
            hist[lag] = hist.get(lag, 0) + int(count)
    events = []
    for entry_id, fields in client.xrevrange(keys.events, count=num_events):
        f = _dec(fields)
        events.append({"id": entry_id.decode(), "kind": f.pop("kind", "?"), "t": _num(f.pop("t", None)), **f})
    stalls = [{**asdict(s), "source": "watchdog"} for s in watchdog.evaluate(now)] if watchdog is not None else []
    # Each role's own report (asyncrl/observe/selfwatch.py): what it waits on, also for roles started by hand.
    from asyncrl.observe.selfwatch import reported

    own = [reported(f"generator:{g['id']}", g.pop("_stall"), now) for g in gens]
    own += [reported("learner", lh, now), reported("buffer", bm, now)]
    stalls += [r for r in own if r is not None]
    lag = {"batches": len(batches), "hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0])))}
    return {"run": keys.run, "time": now, "num_generators": len(gens), "generators": gens, "learner": learner,
            "members": _members(client, keys, cfg, now), "buffer": buffer, "lag": lag, "events": events,
            "stalls": stalls, "stopped": bool(client.exists(keys.stop)),
            "startup": timeline.parse(client.hgetall(keys.timeline))}


def _learner(client, keys: Keys, lh: dict, exporters: dict, now: float) -> dict:
    """The learner's row: its step and version, speed, drops, and the last step's breakdown."""
    return {"step": int(_num(lh.get("step"), 0)), "version": int(_num(client.get(keys.version), 0)),
            "tokens_per_s": _num(lh.get("tokens_per_s"), 0.0), "idle_ratio": _num(lh.get("idle_ratio"), 0.0),
            "updated_age_s": now - _num(lh["updated_at"]) if "updated_at" in lh else None,
            "dropped_groups": int(_num(lh.get("dropped_groups"), 0)),
            "quarantined": int(_num(lh.get("quarantined"), 0)), "metrics_url": exporters.get("learner"),
            # the last step's breakdown: computing, waiting for a batch, held up by the push
            **{k: _num(lh.get(k)) for k in ("compute_s", "data_wait_s", "sync_s", "push_wait_s", "mfu",
                                            "staleness_bound")}}


def _members(client, keys: Keys, cfg: Config, now: float) -> list[dict]:
    """Every generator the run has seen (asyncrl/protocol/members.py), live, stalled or gone, with what
    the OS says of its process when it runs on this host (stopped by SIGSTOP, no longer there)."""
    from asyncrl.observe.watchdog import process_state
    from asyncrl.protocol.members import read_members

    out = read_members(client, keys, cfg.generator.heartbeat_s, cfg.generator.heartbeat_ttl_s, now)
    for m in out:
        m["process"] = process_state(m).removeprefix("; ") or None
    return out


def _members_table(snap: dict):
    from rich.table import Table

    table = Table(title="members (every generator seen: live, stalled, gone)", expand=True)
    for col in ("id", "state", "last heartbeat", "last group", "leases", "process"):
        table.add_column(col)
    for m in snap.get("members", []):
        age = "-" if m["heartbeat_age_s"] is None else f"{m['heartbeat_age_s']:.1f}s ago"
        style = {"stalled": "yellow", "gone": "red"}.get(m["state"], "")
        table.add_row(m["id"], m["state"], age, m["last_group"] or "-", str(m["leases"]), m["process"] or "-",
                      style=style)
    return table


def _roles_table(lr: dict, bf: dict, age):
    """The learner's and the buffer's rows, and the last step's breakdown."""
    from rich.table import Table

    # Two columns: the role, then its fields as one cell that wraps, so that a narrow terminal wraps the
    # line instead of cutting words into "learn…".
    roles = Table(title="learner / buffer", expand=True, show_header=False)
    roles.add_column(no_wrap=True)
    roles.add_column(ratio=1)

    def fields(name: str, *items: str) -> None:
        roles.add_row(name, " \u00b7 ".join(items))

    fields("learner", f"step {lr['step']}", f"version {lr['version']}", f"{lr['tokens_per_s']:.1f} tok/s",
           f"idle {lr['idle_ratio']:.2f}", f"dropped {lr['dropped_groups']}", f"quarantined {lr['quarantined']}",
           f"updated {age(lr['updated_age_s'])}",
           "staleness bound " + (f"{lr['staleness_bound']:.0f}" if lr.get("staleness_bound") is not None else "-"))
    fields("buffer", f"depth {bf['depth']}", f"oldest {bf['oldest_age_s']:.1f}s",
           f"{bf['groups_per_s']:.2f} groups/s", f"backlog {bf['prompt_backlog']}",
           f"released {bf['released']}", f"updated {age(bf['updated_age_s'])}")
    if lr.get("compute_s") is not None:
        fields("last step", f"compute {lr['compute_s']:.3f}s", f"waiting for data {lr['data_wait_s']:.3f}s",
               f"push {lr['sync_s']:.3f}s", f"of which waiting {lr['push_wait_s']:.3f}s",
               f"mfu {lr['mfu']:.1%}" if lr.get("mfu") is not None else "mfu -")
    if bf["rejected"]:  # refused frames and handshakes, by reason
        fields("refused", *[f"{k} {v}" for k, v in bf["rejected"].items()][:7])
    return roles


def render(snap: dict):
    """A rich renderable of one snapshot."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    def age(x):
        return "-" if x is None else f"{x:.1f}s"

    gen = Table(title=f"generators ({snap['num_generators']})", expand=True)
    for col in ("id", "state", "version", "tokens/s", "idle", "groups", "heartbeat"):
        gen.add_column(col)
    for g in snap["generators"]:
        style = "red" if g["heartbeat_age_s"] > 5 else ("yellow" if g["state"] != "generating" else "")
        gen.add_row(g["id"], str(g["state"]), str(g["version"]), f"{g['tokens_per_s']:.1f}",
                    f"{g['idle_ratio']:.2f}", str(g["groups"]), age(g["heartbeat_age_s"]), style=style)
    lr, bf = snap["learner"], snap["buffer"]
    roles = _roles_table(lr, bf, age)
    lag = Table(title=f"version lag, last {snap['lag']['batches']} batches (tokens)", expand=True)
    lag.add_column("lag")
    lag.add_column("tokens")
    lag.add_column("")
    total = max(sum(snap["lag"]["hist"].values()), 1)
    for k, v in snap["lag"]["hist"].items():
        lag.add_row(k, str(v), "█" * max(int(40 * v / total), 1))
    ev = Table(title="recent events", expand=True)
    for col in ("time", "kind", "details"):
        ev.add_column(col)
    for e in snap["events"]:
        details = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("id", "kind", "t"))
        t = time.strftime("%H:%M:%S", time.localtime(e["t"])) if e["t"] else "-"
        ev.add_row(t, e["kind"], details[:100], style="bold red" if e["kind"] in ("stall", "sync_failed") else "")
    parts = [gen, _members_table(snap), roles, lag, ev]
    if snap.get("startup"):
        parts.append(Panel(timeline.describe(snap["startup"]), title="start-up"))
    if snap["stalls"]:
        parts.insert(0, Panel("\n".join(f"{s['role']}: {s['what']} for {s['since_s']:.0f}s: {s['reason']}"
                                        f"{' (its own report)' if s.get('source') == 'self' else ''}"
                                        for s in snap["stalls"]), title="STALLED", style="bold red"))
    state = " (ended)" if snap.get("ended") else (" (stopped)" if snap["stopped"] else "")
    return Panel(Group(*parts), title=f"asyncrl run {snap['run']}{state}")


def main(cfg: Config, redis_url: str, once: bool, as_json: bool, interval_s: float, last_n: int,
         ended: bool = False) -> int:
    """`ended`: the run is over and `redis_url` serves its saved state (asyncrl/observe/ended.py): one
    snapshot, marked as such, with no watchdog (every role would read as stalled)."""
    from asyncrl.observe.watchdog import Watchdog

    client = connect(redis_url)
    keys = Keys(cfg.run.name)
    watchdog = Watchdog(client, keys, cfg) if cfg.run.stall_timeout_s > 0 and not ended else None
    if once:
        snap = {**snapshot(client, keys, cfg, watchdog, last_n), "ended": ended}
        if as_json:
            print(json.dumps(snap, indent=2))
        else:
            from rich.console import Console

            Console().print(render(snap))
        return 0
    from rich.live import Live

    with Live(render(snapshot(client, keys, cfg, watchdog, last_n)), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval_s)
                live.update(render(snapshot(client, keys, cfg, watchdog, last_n)))
        except KeyboardInterrupt:
            pass
    return 0
