"""What the buffer refuses, counted and logged without flooding: frames that fail validation
(`reject:{reason}`) and ZeroMQ handshakes refused on the ingest socket (`auth_refused`).
"""

from __future__ import annotations

import logging
import time

import zmq

from asyncrl.protocol import schema
from buffers.gauges import Counters

log = logging.getLogger("buffers.service")  # the buffer's records keep the one name they have always had

# Rejected frames: counted each, logged once per reason per this many seconds (a fuzzing or broken
# peer sent 14,344 in one run, one WARNING line each).
REJECT_LOG_S = 10.0
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
# A refused handshake on the ingest socket, by what the monitor reports: reason -> what it means.
REFUSALS = {
    "auth_no_credentials": "the peer offers another security mechanism (no CURVE key / run token, or the other one)",
    "auth_wrong_server_key": "the peer's CURVE handshake does not decrypt (wrong server key)",
    "auth_unknown_credentials": "unknown CURVE client key or wrong run token",
    # The peer hung up during the handshake: often one with no credentials that saw the mismatch first.
    "auth_handshake": "the handshake broke off",
}


class Refusals:
    """Counts each refusal in `counters` (`reject:{reason}`, `auth_refused`)."""

    def __init__(self, counters: Counters):
        self.counters = counters
        self.monitor = None  # the ingest socket's handshake monitor, when it has authentication
        self._logged: dict[str, float] = {}  # reason -> when last logged
        self._unlogged: dict[str, int] = {}  # reason -> rejects since then
        self._zap_why = ""

    def reject(self, error: schema.FrameError, nbytes: int) -> None:
        """Counts a refused frame under its reason, logged as `_log` says."""
        self.counters.count(f"reject:{error.reason}")
        self._log(error.reason, f"rejected frame ({nbytes} bytes): {error}")

    def _log(self, reason: str, what: str) -> None:
        """Logs the first of each reason, then at most once per REJECT_LOG_S with how many came since."""
        now = time.monotonic()
        last = self._logged.get(reason)
        if last is not None and now - last < REJECT_LOG_S:
            self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
            return
        more = self._unlogged.pop(reason, 0)
        self._logged[reason] = now
        since = f" (+{more} more since the last line)" if more else ""
        log.warning("%s%s; total %s=%d", what, since, reason, self.counters[f"reject:{reason}"])

    def zap_refused(self, why: str) -> None:
        """The ZAP handler's refusals are counted by the monitor (HANDSHAKE_FAILED_AUTH); the status
        text is kept for the next log line of that reason."""
        self._zap_why = why

    def check_handshakes(self) -> int:
        """Counts the ingest socket's refused handshakes (`auth_refused`, and by reason); returns how many."""
        if self.monitor is None:
            return 0
        from zmq.utils.monitor import parse_monitor_message

        num = 0
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return num
            num += 1
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                reason, detail = "auth_unknown_credentials", self._zap_why
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                reason, detail = "auth_no_credentials", ""
            elif event["value"] == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
                reason, detail = "auth_wrong_server_key", ""
            else:
                reason, detail = "auth_handshake", f"{event['event'].name}, {event['value']}"
            self.counters.count("auth_refused")
            self.counters.count(f"reject:{reason}")
            detail = f" ({detail})" if detail else ""
            self._log(reason, f"refused a ZeroMQ connection on {event['endpoint'].decode()}: "
                              f"{REFUSALS[reason]}{detail}")
