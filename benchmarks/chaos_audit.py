"""The chaos soak's audit (benchmarks/chaos_soak.py): what became of every released prompt, from what
the run itself records.

Sources, and how exact each is:
- `prompts` stream: every release (the buffer's XADDs; a reclaimed or handed-back lease is copied to
  the tail and the old entry deleted, so the newest entry of a group id says its state: undelivered,
  leased (pending in the `generators` group) or acked, which a generator does only once the group's
  `seen:` key shows it ingested). `cursor.released` counts releases. Exact, by group id.
- `trajectories` stream (never trimmed): every stored group, by group id; the buffer's dedupe script
  stores a group id at most once. Exact, by group id.
- the learner's consumer group: its pending list (delivered, not acked) and last-delivered id
  (what it has not read). Exact, by entry id.
- `quarantine` stream: entries the learner refused, with entry id and reason. Exact, by entry id.
- the `learner` hash: `dropped_groups` (stale, ahead of the learner, quarantined; each counted by
  what its XACK acked, so a retry never counts twice) and `quarantined`. Exact counts, no ids: which
  acked groups were trained and which dropped as stale is recorded only as a count (the
  `drop_stale` events carry numbers, not ids).
- `metrics.jsonl`: one row per step, appended by every learner incarnation; a restarted learner
  resumes its checkpoint and writes the rolled-back steps again, so the saved model's history is the
  last row of each step number. `num_groups` per step, no ids. Exact count of the groups trained
  into the saved model.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from asyncrl.protocol import schema
from asyncrl.protocol.keys import LEARNER_GROUP, PROMPT_GROUP, Keys

NOT_BY_ID = ("which acked trajectory groups were trained and which were dropped as stale (or as sampled ahead "
             "of a restarted learner's version) is recorded by count only: metrics.jsonl rows carry num_groups "
             "per step and drop_stale events carry counts, neither names group ids. Trained-once is therefore "
             "checked as counts: groups in the saved model's step history == groups acked by the learner - "
             "quarantined - dropped; a duplicate and a loss in the same run would cancel out in that check")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _id_key(entry_id) -> tuple[int, int]:
    ms, seq = _text(entry_id).split("-")
    return int(ms), int(seq)


def _all_entries(client, stream: str) -> list:
    out, start = [], "-"
    while True:
        batch = client.xrange(stream, min=start, count=10_000)
        if not batch:
            return out
        out += batch
        if len(batch) < 10_000:
            return out
        ms, seq = _id_key(batch[-1][0])
        start = f"{ms}-{seq + 1}"


def _pending_ids(client, stream: str, group: str) -> set[str]:
    out, start = set(), "-"
    while True:
        rows = client.xpending_range(stream, group, min=start, max="+", count=10_000)
        out |= {_text(r["message_id"]) for r in rows}
        if len(rows) < 10_000:
            return out
        ms, seq = _id_key(rows[-1]["message_id"])
        start = f"{ms}-{seq + 1}"


def _last_delivered(client, stream: str, group: str) -> tuple[int, int]:
    for info in client.xinfo_groups(stream):
        if _text(info["name"]) == group:
            return _id_key(info["last-delivered-id"])
    return (0, 0)


def lineage(rows: list[dict]) -> dict:
    """The saved model's step history from every incarnation's rows: the last row of each step."""
    last: dict[int, dict] = {}
    for r in rows:
        last[r["step"]] = r
    steps = sorted(last)
    versions = [last[s]["version"] for s in steps]
    rolled_back = len(rows) - len(steps)
    return {
        "steps": len(steps), "first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None,
        "contiguous": steps == list(range(1, len(steps) + 1)),
        "versions_monotonic": all(b == a + 1 for a, b in zip(versions, versions[1:], strict=False)),
        "final_version": versions[-1] if versions else None,
        "groups_trained": sum(last[s]["num_groups"] for s in steps),
        "rows_written": len(rows), "rows_rolled_back": rolled_back,
    }


def _incarnations(rows: list[dict]) -> dict:
    """Version history per learner incarnation: a step number that does not follow the last row's
    starts a new incarnation (a resume); within one the versions must rise by one a step."""
    runs, current = [], []
    for r in rows:
        if current and r["step"] != current[-1]["step"] + 1:
            runs.append(current)
            current = []
        current.append(r)
    if current:
        runs.append(current)
    rollbacks = [runs[i][-1]["version"] - (runs[i + 1][0]["version"] - 1) for i in range(len(runs) - 1)]
    monotonic = all(all(b["version"] == a["version"] + 1 for a, b in zip(run, run[1:], strict=False))
                    for run in runs)
    return {"segments": len(runs), "monotonic_within_each": monotonic,
            "rollbacks_versions": rollbacks}


def audit(client, keys: Keys, run_dir: Path, poison: dict) -> dict:
    """The audit's figures and checks; `poison`: what the soak injected (ingest frames by reason, entry
    ids written straight into the trajectories stream)."""
    # ---- released prompts, by group id --------------------------------------------------------------
    prompt_entries = _all_entries(client, keys.prompts)
    newest: dict[str, str] = {}
    per_id = Counter()
    for entry_id, fields in prompt_entries:
        task = schema.decode(fields[b"data"], schema.PromptTask)
        per_id[task.group_id] += 1
        newest[task.group_id] = _text(entry_id)
    released = int(client.hget(keys.cursor, "released") or 0)
    leased = _pending_ids(client, keys.prompts, PROMPT_GROUP)
    delivered_to = _last_delivered(client, keys.prompts, PROMPT_GROUP)

    # ---- stored groups, by group id -----------------------------------------------------------------
    traj_entries = _all_entries(client, keys.trajectories)
    stored: dict[str, list[str]] = {}
    undecodable = []
    for entry_id, fields in traj_entries:
        try:
            group = schema.decode(fields[b"data"], schema.TrajectoryGroup)
        except (KeyError, schema.FrameError):
            undecodable.append(_text(entry_id))
            continue
        stored.setdefault(group.group_id, []).append(_text(entry_id))

    # ---- the learner's side, by entry id ------------------------------------------------------------
    learner_pending = _pending_ids(client, keys.trajectories, LEARNER_GROUP)
    learner_read_to = _last_delivered(client, keys.trajectories, LEARNER_GROUP)
    quarantine = {_text(f[b"entry"]): _text(f[b"reason"]) for _, f in _all_entries(client, keys.quarantine)}
    learner_hash = {_text(k): _text(v) for k, v in client.hgetall(keys.learner).items()}
    dropped_groups = int(learner_hash.get("dropped_groups", 0))
    quarantined_count = int(learner_hash.get("quarantined", 0))

    # ---- each released prompt's fate ----------------------------------------------------------------
    fate = Counter()
    lost_ids = []
    for gid, entry in newest.items():
        if gid in stored:
            fate["stored"] += 1
        elif entry in leased:
            fate["leased_at_stop"] += 1  # in a generator's hands when the run stopped
        elif _id_key(entry) > delivered_to:
            fate["unleased_at_stop"] += 1  # released, never leased before the stop
        else:
            fate["lost"] += 1  # acked by a generator (it does so only once ingested) yet never stored
            lost_ids.append(gid)
    stored_unreleased = sorted(set(stored) - set(newest))

    # ---- each stored entry's fate on the learner's side ---------------------------------------------
    valid_entries = [e for es in stored.values() for e in es]
    side = Counter()
    for e in valid_entries:
        if e in quarantine:
            side["quarantined"] += 1
        elif e in learner_pending:
            side["delivered_not_acked_at_stop"] += 1
        elif _id_key(e) > learner_read_to:
            side["unread_at_stop"] += 1
        else:
            side["acked"] += 1
    quarantined_valid = side["quarantined"]
    dropped_not_quarantined = dropped_groups - quarantined_count  # stale or ahead (dynamic_sampling is off)
    trained_by_count = side["acked"] - dropped_not_quarantined

    rows_path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    history = lineage(rows)
    difference = history["groups_trained"] - trained_by_count

    # ---- poison -------------------------------------------------------------------------------------
    written = poison.get("written", [])
    written_fate = {e["entry"]: quarantine.get(e["entry"], "NOT QUARANTINED") for e in written}
    rejects = {_text(k)[len("buffer:reject:"):]: int(float(v)) for k, v in client.hgetall(keys.metrics).items()
               if _text(k).startswith("buffer:reject:")}
    sent = sum(poison.get("frames_sent", {}).values())

    duplicates_in_stream = sum(len(es) - 1 for es in stored.values())
    return {
        "prompts": {
            "released": released, "released_group_ids": len(newest),
            "release_entries": len(prompt_entries), "group_ids_with_more_than_one_entry":
                sum(1 for n in per_id.values() if n > 1),
            "fate": dict(fate), "lost_group_ids": lost_ids[:50],
        },
        "trajectories": {
            "entries": len(traj_entries), "groups": len(stored), "undecodable_entries": len(undecodable),
            "group_ids_stored_twice": duplicates_in_stream, "stored_but_never_released": stored_unreleased[:50],
            "learner_side": dict(side),
        },
        "learner": {
            "dropped_groups": dropped_groups, "quarantined": quarantined_count,
            "dropped_stale_or_ahead": dropped_not_quarantined,
            "trained_by_count": trained_by_count, "saved_model_history": history,
            "incarnations": _incarnations(rows),
            "saved_minus_acked_trained": difference,
        },
        "quarantine": {
            "entries": len(quarantine), "reasons": dict(Counter(quarantine.values())),
            "valid_groups_quarantined": quarantined_valid,
            "written_straight_into_trajectories": written_fate,
            "of_those_in_the_saved_history": "none can be: each is in the quarantine stream, acked, and counted "
                                             "in dropped_groups" if all(v != "NOT QUARANTINED"
                                                                        for v in written_fate.values())
                                             else "some were not quarantined",
            "ingest_frames_sent": poison.get("frames_sent", {}), "ingest_frames_confirmed_refused":
                poison.get("frames_confirmed", 0), "buffer_reject_counters": rejects,
            "buffer_reject_total": sum(rejects.values()), "ingest_frames_sent_total": sent,
            "note": "buffer reject counters are published once a second; a buffer killed within that second "
                    "loses the increments since its last publish, so the total may be short of frames sent",
        },
        "checks": {
            "duplicates": duplicates_in_stream + max(difference, 0),
            "lost": fate["lost"] + max(-difference, 0),
            "poison_not_quarantined": sum(1 for v in written_fate.values() if v == "NOT QUARANTINED"),
            "stored_but_never_released": len(stored_unreleased),
            "saved_history_contiguous_and_monotonic": history["contiguous"] and history["versions_monotonic"],
        },
        "not_established_by_id": NOT_BY_ID,
    }
