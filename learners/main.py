"""torchrun entry point: `torchrun --nproc-per-node 2 -m learners.main CONFIG [overrides]`.

Ctrl-C (SIGINT to the terminal's process group: torchrun's agent and every rank) ends each rank at
once with one line from rank 0, not a KeyboardInterrupt traceback from wherever it landed (inside
`backward()`, a gather, a Redis read). Nothing is lost by leaving at once: the trajectories of steps
no checkpoint holds are still unacked, so `run.resume=true` trains them again. On its way out rank 0
closes its weight group in Redis (an epoch naming no member), so that a generator told to leave next
does not wait for a learner that is gone to re-form the group without it.
"""

import os
import signal
import sys

from asyncrl.launch.cli import main

CLOSE_REDIS_S = 1.0  # the weight group's close: one quick try, never a wait on a Redis that is gone


def _close_weight_group(argv: list[str]) -> None:
    """Publishes `wgroup` as the next epoch with no member (best effort, bounded)."""
    import time

    import redis

    from asyncrl.config import load_config
    from asyncrl.protocol import schema
    from asyncrl.protocol.keys import Keys, _auth_kwargs
    from asyncrl.protocol.store import set_and_notify

    config = argv[0] if argv and "=" not in argv[0] else None
    cfg = load_config(config, argv[1:] if config else argv)
    client = redis.Redis.from_url(cfg.buffer.redis_url, socket_timeout=CLOSE_REDIS_S,
                                  socket_connect_timeout=CLOSE_REDIS_S, retry=None, **_auth_kwargs())
    keys = Keys(cfg.run.name)
    if (frame := client.get(keys.wgroup)) is None:
        return
    last = schema.decode(frame, schema.GroupEpoch)
    closed = schema.GroupEpoch(schema_version=last.schema_version, epoch=last.epoch + 1, addr="", port=0,
                               members=[], backend=last.backend, opened_at=time.time())
    set_and_notify(client, keys, keys.wgroup, schema.encode(closed), "weights")


def _on_interrupt(signum: int, _frame) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"learner: interrupted ({signal.Signals(signum).name}): leaving now; run.resume=true goes on from the "
              "newest checkpoint", file=sys.stderr, flush=True)
        try:
            _close_weight_group(sys.argv[1:])
        except Exception as e:  # Redis gone or the config unreadable: generators fall back to their bound
            print(f"learner: weight group not closed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _on_interrupt)
    sys.exit(main(["learner", *sys.argv[1:]]))
