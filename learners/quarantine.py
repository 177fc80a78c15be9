"""Learner rank 0's defence in depth: a group it cannot train is moved aside, never trained, never fatal.

The buffer validates every frame against the run (asyncrl/protocol/schema.py `validate_for_run`, and ids
against what it released), but the trajectories stream can also be written by anything holding the
Redis password, by a buffer of another config, or hold entries from before an upgrade. A group
that reached the learner and fails the same checks (or does not decode) would otherwise crash the
step (an IndexError in the log-prob gather for a token id past the vocabulary) and, unacked, crash
every restart again. Instead it is:
- appended to the dead-letter stream `asyncrl:{run}:quarantine` (entry id, group id, reason, detail,
  the frame itself, capped at MAXLEN entries) for a person to inspect;
- acked, in the same script, and given back to the admission budget (`dropped_groups`) like a stale
  group, so poison cannot starve the pipe;
- counted: `quarantined` in the `learner` hash (what `asyncrl status` shows), the step's metrics row,
  and one `quarantine` event per group.
The same screen runs on the recovery path (groups delivered before a restart, never acked), and
both paths read an entry the same way (`Quarantine.entry`): an entry deleted from the stream after
delivery (no fields at all) is acked, since there is nothing to train or keep; one that has fields
but no `data`, or whose frame does not decode (another schema version included), is quarantined.
"""

from __future__ import annotations

import logging

from asyncrl.protocol import schema
from asyncrl.protocol.keys import LEARNER_GROUP, Keys, log_event

log = logging.getLogger(__name__)

MAXLEN = 10_000  # dead-letter entries kept (approximate trim): the frames are evidence, not a queue

# Move one entry: only if this call acks it (a retried script, asyncrl/protocol/retry.py, counts it once).
QUARANTINE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'entry', ARGV[2], 'group_id', ARGV[4],
           'reason', ARGV[5], 'detail', ARGV[6], 'data', ARGV[7])
redis.call('HINCRBY', KEYS[3], 'quarantined', 1)
redis.call('HINCRBY', KEYS[3], 'dropped_groups', 1)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[8], '*', 'k', 'version')
return 1
"""


class Quarantine:
    """Screens (entry_id, group) pairs against `limits`; moves the failures to the dead-letter stream."""

    def __init__(self, client, keys: Keys, limits: schema.RunLimits):
        self.client, self.keys, self.limits = client, keys, limits
        self.num = 0  # moved by this process (the `learner` hash holds the run's total)
        self.num_deleted = 0  # entries found deleted from the stream (acked)

    def problem(self, group: schema.TrajectoryGroup) -> schema.FrameError | None:
        """What makes `group` untrainable here, or None. The wire checks run again: an entry may not
        have come through a buffer at all."""
        try:
            schema.validate_group(group, max_tokens=self.limits.max_tokens)
            schema.validate_for_run(group, self.limits)
        except schema.FrameError as e:
            return e
        return None

    def screen(self, pairs: list) -> list:
        """The trainable (entry_id, group) pairs of `pairs`, in order; the others are quarantined."""
        keep = []
        for entry_id, group in pairs:
            error = self.problem(group)
            if error is None:
                keep.append((entry_id, group))
            else:
                self.put(entry_id, group.group_id, error, schema.encode(group))
        return keep

    def entry(self, entry_id, fields) -> schema.TrajectoryGroup | None:
        """A stream entry's group, or None when it is not trainable: deleted from the stream after
        delivery (no fields: acked, counted in `num_deleted`), or quarantined (`decode`)."""
        if not fields:
            self.client.xack(self.keys.trajectories, LEARNER_GROUP, entry_id)
            self.num_deleted += 1
            return None
        return self.decode(entry_id, fields.get(b"data"))

    def decode(self, entry_id, frame: bytes | None) -> schema.TrajectoryGroup | None:
        """A stored frame decoded, or None after quarantining it: no frame, bad bytes, or a frame of
        another schema version (one such entry is poison like any other; a whole run written by
        another asyncrl is refused at start by its identity, asyncrl/protocol/identity.py)."""
        if frame is None:
            self.put(entry_id, "", schema.FrameError("missing", "entry has no data field"), b"")
            return None
        try:
            return schema.decode(frame, schema.TrajectoryGroup)
        except schema.FrameError as e:
            self.put(entry_id, "", e, bytes(frame))
            return None

    def put(self, entry_id, group_id: str, error: schema.FrameError, frame: bytes) -> bool:
        """Moves one entry to the dead-letter stream (acked, counted, an event); False if it was
        already acked (nothing moved)."""
        from asyncrl.protocol.notify import MAXLEN as NOTIFY_MAXLEN

        detail = str(error)[:500]
        moved = bool(self.client.eval(QUARANTINE, 4, self.keys.trajectories, self.keys.quarantine, self.keys.learner,
                                      self.keys.notify, LEARNER_GROUP, entry_id, MAXLEN, group_id, error.reason,
                                      detail, frame, NOTIFY_MAXLEN))
        if moved:
            self.num += 1
            log.warning("quarantined trajectory entry %s (group %r): %s; not trained, see %s",
                        _text(entry_id), group_id, detail, self.keys.quarantine)
            log_event(self.client, self.keys, "quarantine", entry=_text(entry_id), id=group_id, reason=error.reason)
        return moved


def _text(entry_id) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
