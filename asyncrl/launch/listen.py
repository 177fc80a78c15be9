"""`python -m asyncrl.launch.listen TORCHRUN_ARGS...`: torchrun with its rendezvous stores bound to
the address they are given (`--master-addr` / the `--rdzv-endpoint` host), not to every interface
(asyncrl/protocol/tcpstore.py says why); the launcher runs the learner through it.
"""

from __future__ import annotations

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


def main() -> None:
    _patch_torchrun()
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
