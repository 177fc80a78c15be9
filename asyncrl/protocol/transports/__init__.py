"""Weight transports by name: one module each, behind asyncrl/protocol/transports/base.py `Transport`.

`weights.backend` names one of them; `auto` takes the one whose `auto` says yes for the learner's
device and where the epoch's members run (asyncrl/protocol/weight_sync.py `choose_backend`). A new
transport is a module that defines a `Transport`, and its line here.
"""

from __future__ import annotations

from asyncrl.protocol.transports import gloo, ipc, nccl
from asyncrl.protocol.transports.base import Transport

TRANSPORTS: dict[str, Transport] = {t.name: t for t in (gloo.TRANSPORT, nccl.TRANSPORT, ipc.TRANSPORT)}
