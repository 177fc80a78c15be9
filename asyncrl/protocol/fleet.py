"""The generator fleet as the learner sees it: heartbeats read in one round trip, which of them may
join weight groups, and whether the weights they report are the ones the learner sent.

Beside the weight protocol (asyncrl/protocol/weight_sync.py), which moves the weights; this module only
reads `gen:{id}` heartbeats (asyncrl/protocol/schema.py `Heartbeat`). Readers take one snapshot per decision
and pass it on, instead of each scanning Redis again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import Keys, log_event
from asyncrl.protocol.schema import Heartbeat

log = logging.getLogger(__name__)

KEEP_VERSIONS = 4  # versions behind the learner's whose sent checksums are still checked

_warned_malformed: set[bytes] = set()  # Redis keys of malformed heartbeats already warned about


def read_fleet(client, keys: Keys) -> dict[str, Heartbeat]:
    """Every live heartbeat, by generator id: one SCAN, then one pipelined HGETALL of all keys.
    A malformed heartbeat is skipped, with one warning per key: a garbage hash in Redis (a
    foreign writer, a half-written test fixture) must never stop the learner or a monitor."""
    names = list(client.scan_iter(keys.gen_pattern, count=1000))
    if not names:
        return {}
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    fleet = {}
    for name, raw in zip(names, pipe.execute(), strict=True):
        if not raw:  # expired between the SCAN and the HGETALL
            continue
        try:
            hb = Heartbeat.from_hash(raw)
        except schema.FrameError as e:
            if name not in _warned_malformed:
                _warned_malformed.add(name)
                log.warning("heartbeat %s is malformed (%s): ignored", name.decode(errors="replace"), e)
            continue
        fleet[hb.id] = hb
    return fleet


# ---- admission -----------------------------------------------------------------------------------


def admitted(cfg, hb: Heartbeat) -> tuple[bool, str, str]:
    """(ok, why, event kind): a generator joins weight groups only with a valid run token
    (deploy.run_token_file, asyncrl/protocol/security.py) and this learner's schema version: one speaking
    another (a node left on an older install) would fail every sync it is in, and the learner
    re-formed epochs around it forever."""
    if not security.proof_ok(security.run_token(cfg), hb.id, hb.token_proof):
        return False, "presents no valid run token", "auth_refused"
    if hb.schema_version != schema.SCHEMA_VERSION:
        return False, (f"speaks schema version {hb.schema_version}, this learner {schema.SCHEMA_VERSION}"), \
            "schema_refused"
    return True, "", ""


class Admission:
    """`admitted`, with each refusal warned about once per generator and logged as an event."""

    def __init__(self, cfg, client, keys: Keys):
        self.cfg, self.client, self.keys = cfg, client, keys
        self.refused: set[tuple[str, str]] = set()  # (generator id, event kind) already reported

    def __call__(self, hb: Heartbeat) -> bool:
        ok, why, kind = admitted(self.cfg, hb)
        if not ok and (hb.id, kind) not in self.refused:
            self.refused.add((hb.id, kind))
            log.warning("generator %s %s: ignored (not in any weight group)", hb.id, why)
            log_event(self.client, self.keys, kind, id=hb.id)
        return ok


def live_members(fleet: dict[str, Heartbeat], admit: Callable[[Heartbeat], bool]) -> list[str]:
    """The weight-group members `{id}.{worker}` of every admitted generator that is not draining, sorted."""
    members = []
    for hb in fleet.values():
        if hb.state != "draining" and admit(hb):
            members += [f"{hb.id}.{r}" for r in range(hb.workers)]
    return sorted(members)


# ---- weight verification ---------------------------------------------------------------------------


class WeightCheck:
    """Each generator reports the version it holds and the checksums of the buckets it received;
    they must equal what the learner sent for that version. Each (generator, version) is checked once."""

    def __init__(self):
        self.synced: dict[int, list[int]] = {}  # version -> bucket checksums the learner broadcast
        self.verified: set[tuple[str, int]] = set()  # (generator id, version) already checked
        self.num_verified = self.num_mismatch = 0

    def sent(self, version: int, checksums: list[int]) -> None:
        self.synced[version] = list(checksums)

    def check(self, fleet: dict[str, Heartbeat], version: int) -> list[tuple[str, int, list[int], list[int]]]:
        """Checks the reports not yet checked; returns the mismatches as (id, version, got, sent).
        Forgets what it sent for versions more than KEEP_VERSIONS behind `version` (the learner's)."""
        mismatches = []
        for hb in fleet.values():
            if hb.version not in self.synced or (hb.id, hb.version) in self.verified:
                continue
            self.verified.add((hb.id, hb.version))
            if hb.checksums == self.synced[hb.version]:
                self.num_verified += 1
            else:
                self.num_mismatch += 1
                mismatches.append((hb.id, hb.version, hb.checksums, self.synced[hb.version]))
        for v in [v for v in self.synced if v < version - KEEP_VERSIONS]:
            del self.synced[v]
        return mismatches


def node_id() -> str:
    """This machine's identity for the ipc choice: its hostname and boot id (two containers of one host
    share the boot id but may not share GPUs by handle, so both must match)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
