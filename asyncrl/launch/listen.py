"""`python -m asyncrl.launch.listen TORCHRUN_ARGS...`: torchrun with its rendezvous stores bound to
the address they are given (`--master-addr` / the `--rdzv-endpoint` host), not to every interface
(asyncrl/protocol/tcpstore.py says why); the launcher runs the learner through it.
"""

from __future__ import annotations

import logging
import sys

from asyncrl.protocol.tcpstore import bound_tcpstore_class


def _patch_torchrun() -> None:
    """Every TCPStore torchrun's agent creates (static and c10d rendezvous) becomes a bound one."""
    import importlib

    import torch.distributed as dist

    cls = bound_tcpstore_class()
    dist.TCPStore = cls
    for name in ("torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
                 "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "torch.distributed.rendezvous"):
        module = importlib.import_module(name)
        if hasattr(module, "TCPStore"):
            module.TCPStore = cls


class _QuietOnSignal(logging.Filter):
    """Drops torchrun's two warnings when a signal ends it ("Received 2 death signal, shutting down
    workers", "Sending process N closing signal SIGINT"): Ctrl-C of a learner is one line, its rank 0's
    (learners/main.py), and the launcher's teardown prints none."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not ("death signal, shutting down workers" in text or " closing signal " in text)


def main() -> None:
    _patch_torchrun()
    for name in ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api"):
        logging.getLogger(name).addFilter(_QuietOnSignal())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    sys.argv[0] = "torchrun"
    try:
        torchrun_main()
    except SignalException as e:
        # The launcher's SIGTERM at teardown: torchrun has stopped its ranks already; an exit code
        # says so, a traceback on the run's terminal would not.
        sys.exit(128 + int(e.sigval))


if __name__ == "__main__":
    main()
