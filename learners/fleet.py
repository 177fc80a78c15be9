"""Learner rank 0's view of the generator fleet: heartbeat snapshots, the weight-group members it
admits, and the check of the weights each generator reports holding (asyncrl/protocol/fleet.py).
"""

from __future__ import annotations

import logging

from asyncrl.config import Config
from asyncrl.protocol import fleet as fleet_rules
from asyncrl.protocol import schema
from asyncrl.protocol.keys import Keys, log_event
from asyncrl.protocol.weight_sync import WeightSender, choose_backend

log = logging.getLogger("learners.trainer")  # the learner's records keep the one name they have always had


class Fleet:
    def __init__(self, cfg: Config, client, keys: Keys):
        self.cfg, self.client, self.keys = cfg, client, keys
        self.admission = fleet_rules.Admission(cfg, client, keys)
        self.weight_check = fleet_rules.WeightCheck()  # what we broadcast per version against what generators report

    def read_fleet(self) -> dict[str, schema.Heartbeat]:
        """One snapshot of the heartbeats (asyncrl/protocol/fleet.py): read once per decision and passed on."""
        return fleet_rules.read_fleet(self.client, self.keys)

    def live_members(self, fleet: dict[str, schema.Heartbeat] | None = None) -> list[str]:
        """The weight-group members of `fleet` (a fresh read when None) that asyncrl/protocol/fleet.py
        admits; each refusal is warned about once per generator and logged as an event."""
        return fleet_rules.live_members(self.read_fleet() if fleet is None else fleet, self.admission)

    def present_members(self) -> list[str]:
        """The weight-group members whose generator still has a heartbeat, draining ones included (a
        drain keeps its generator in the push under way): a push gives up on a member only when it
        is gone (`WeightSender.member_gone`)."""
        return sorted(f"{hb.id}.{r}" for hb in self.read_fleet().values() for r in range(hb.workers))

    def needs_sync(self, sender: WeightSender, fleet: dict[str, schema.Heartbeat] | None = None) -> bool:
        """The live members differ from the group's, or a failed push dropped the group while members live."""
        live = set(self.live_members(fleet))
        return live != set(sender.members) or (bool(live) and sender.pg is None)

    def epoch_backend(self, members: list[str], cuda: bool) -> str:
        """weights.backend for an epoch of `members` (`{generator}.{worker}`): see `choose_backend`."""
        if self.cfg.weights.backend != "auto" or not cuda:
            return choose_backend(self.cfg.weights.backend, cuda, False)
        fleet, here = self.read_fleet(), fleet_rules.node_id()
        ids = {m.rsplit(".", 1)[0] for m in members}
        local = bool(ids) and all(gid in fleet and fleet[gid].node == here for gid in ids)
        return choose_backend("auto", True, local)

    def verify_fleet_weights(self, fleet: dict[str, schema.Heartbeat], version: int) -> None:
        """The weights each generator reports holding must be the ones we sent for that version
        (asyncrl/protocol/fleet.py `WeightCheck`). A mismatch is an error event, not silence."""
        for gid, v, got, sent in self.weight_check.check(fleet, version):
            log.error("generator %s reports version %d with checksums %s, learner sent %s", gid, v, got, sent)
            log_event(self.client, self.keys, "weights_mismatch", id=gid, version=v)
