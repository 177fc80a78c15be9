"""`asyncrl generator CONFIG --id g0`: lease prompts, sample groups, score, push each group at once.

State machine: `waiting_weights` (holds no current version: generates nothing) -> `generating`
<-> `syncing`; SIGTERM -> `draining` (no new leases, in-flight groups finish and are pushed) -> gone.

`Generator` ties the parts, each a module of its own: the heartbeat (generators/heartbeat.py), the
weight loads (generators/weights.py), the lease loop (generators/leasing.py), one prompt into one
group (generators/groups.py), and the way out with its time bounds (generators/leave.py).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq.asyncio

from asyncrl.config import Config
from asyncrl.launch.leaving import Leaving, kill_children
from asyncrl.protocol import schema, security
from asyncrl.protocol.keys import Keys, aconnect
from asyncrl.protocol.notify import AsyncNotifications
from asyncrl.tasks.rewards import RewardPool, build_reward
from generators.evaluation import EvalWorker
from generators.groups import GroupSampler
from generators.heartbeat import Heartbeat
from generators.leasing import Leaser
from generators.leave import LEAVE_MARGIN_S, WayOut
from generators.outbox import GroupOutbox
from generators.weights import WeightFollower

log = logging.getLogger(__name__)


class Generator:
    def __init__(self, cfg: Config, generator_id: str, engine=None):
        self.cfg = cfg
        self.id = generator_id
        self.keys = Keys(cfg.run.name)
        self.engine = engine
        self.reward_fn = build_reward(cfg.reward)
        self.rewards = RewardPool(self.reward_fn, cfg.reward.workers)  # off the event loop
        self.evals = EvalWorker(self)  # eval rounds (asyncrl/tasks/evaluation.py), leased before training prompts
        self.version = -1  # the policy version these weights are; -1 = none yet
        self.epoch = -1
        self.state = "starting"
        self.inflight: set[asyncio.Task] = set()
        self.stopping = asyncio.Event()
        self.run_over = False  # the learner finished (the `stop` key), as opposed to a SIGTERM drain
        self.leave_deadline: float | None = None  # time.monotonic() by which the process is gone
        self.tokens = 0  # of the pushed groups' samples (what the learner trains on)
        self.baseline_tokens = 0  # of the greedy completions that give advantage=remax its baselines
        self.groups = 0
        self.reward_errors = 0
        self.idle_s = 0.0
        self.sync_s_total = 0.0
        self.last_pause_s = 0.0
        self.num_syncs = 0
        self.started = time.monotonic()
        self.last_checksums: list[int] = []
        from asyncrl.registry import ADVANTAGES

        self.greedy_baseline = bool(ADVANTAGES.static_meta(cfg.algorithm.advantage).get("greedy_baseline"))
        from asyncrl.tasks.registry import get_task

        # A task with an environment is played as multi-turn episodes (generators/episodes.py).
        self.env_factory = get_task(cfg.data.task).environment
        self.sampling = schema.SamplingInfo(temperature=cfg.generator.temperature, top_p=cfg.generator.top_p,
                                            top_k=cfg.generator.top_k)
        self.pulse = Heartbeat(self)
        self.weights = WeightFollower(self)
        self.leaser = Leaser(self)
        self.sampler = GroupSampler(self)
        self.way_out = WayOut(self)

    # ---- set-up --------------------------------------------------------------------------------

    async def start(self) -> None:
        from transformers import AutoTokenizer

        # Retries a lost Redis (restart) with backoff for buffer.redis_retry_s: every loop below rides it out.
        self.redis = await aconnect(self.cfg.buffer.redis_url, retry_s=self.cfg.buffer.redis_retry_s)
        from asyncrl.protocol.identity import claim_from_config

        # A finished or foreign run of this name is refused before anything of it is read.
        await asyncio.to_thread(claim_from_config, self.cfg, f"generator {self.id}")
        self.notes = AsyncNotifications(self.cfg.buffer.redis_url, self.keys)  # its reader runs in run()
        from asyncrl.protocol import sampling

        await sampling.check_generator(self.redis, self.keys, self.cfg.generator, self.id)  # before the engine
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_path)
        if self.env_factory is not None:
            from generators.episodes import EpisodeLimits, TurnCodec

            self.codec = TurnCodec(self.tokenizer, self.cfg.data.chat_template)
            self.episode_limits = EpisodeLimits.from_config(self.cfg)
        from asyncrl.observe import timeline

        await timeline.mark(self.redis, self.keys, f"{self.id} process", timeline.process_start())
        # From here the engine's own start (vLLM: its engine process, model load, compile, graphs):
        # what comes before it is this process's imports, Redis and the tokenizer.
        await timeline.mark(self.redis, self.keys, f"{self.id} engine start")
        if self.engine is None:
            from generators.backends import build_engine

            self.engine = build_engine(self.cfg)
        await timeline.mark(self.redis, self.keys, f"{self.id} engine")
        # Weights on disk are version 0; they are current only while the learner is still at 0.
        learner_version = int(await self.redis.get(self.keys.version) or 0)
        wsync = await self.redis.get(self.keys.wsync)
        if learner_version == 0 and wsync is None:
            self.version = 0
        self._drain_on_signal()
        await self._open_outbox()

    def _drain_on_signal(self) -> None:
        """From here a signal drains (generators/leave.py) instead of ending the start-up (main())."""
        self.leaving = Leaving(f"generator {self.id}", "generator.drain_timeout_s", self.cfg.generator.drain_timeout_s,
                               self.stopping.set, margin_s=LEAVE_MARGIN_S)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.leaving.on_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self.leaving.on_signal, signal.SIGINT)

    async def _open_outbox(self) -> None:
        """The ZeroMQ side and the first heartbeat: from here the fleet sees this generator."""
        self.ctx = zmq.asyncio.Context()
        # Pushed groups stay in the outbox until the buffer has ingested them (generators/outbox.py).
        self.outbox = GroupOutbox(self.redis, self.keys, self.id, self.cfg.buffer.lease_timeout_s, ctx=self.ctx,
                                  secure=self._secure_socket, on_refused=self._refused)  # asyncrl/protocol/security.py
        addr = await self.outbox.connect()
        from asyncrl.observe.exporter import exporter_field, start_exporter

        self.exporter = start_exporter(self.cfg, "generator", self.id)  # /metrics; URL published below
        if self.exporter is not None:
            await self.redis.hset(self.keys.exporters, exporter_field("generator", self.id), self.exporter.url)
        await self.heartbeat()
        await self.redis.xadd(self.keys.events, {"kind": "generator_join", "id": self.id, "t": f"{time.time():.3f}"})
        log.info("generator %s up: ingest=%s version=%d", self.id, addr, self.version)

    def _secure_socket(self, sock) -> bool:
        return security.secure_client_socket(self.cfg, sock)

    def _refused(self, error: Exception) -> None:
        """The buffer refused our run token / CURVE key: stop, and exit non-zero (run() re-raises)."""
        self.auth_failure = error
        self.stopping.set()

    # ---- the parts: heartbeat, weights, leases, groups, leaving --------------------------------

    async def heartbeat(self) -> None:
        await self.pulse.write()

    async def weights_loop(self) -> None:
        await self.weights.loop()

    async def _follow_weights(self, last_ann):
        return await self.weights.follow(last_ann)

    async def lease_loop(self) -> None:
        await self.leaser.loop()

    async def process(self, entry_id: bytes, task: schema.PromptTask) -> None:
        await self.leaser.wait_for_turn()
        await self.sampler.sample(entry_id, task)

    def _done(self, task: asyncio.Task) -> None:
        self.leaser.done(task)

    async def _announce_draining(self) -> None:
        await self.way_out.announce_draining()

    # ---- the run -------------------------------------------------------------------------------

    async def run(self) -> None:
        self.auth_failure = None
        await self.start()
        helpers = [asyncio.create_task(c) for c in (self.notes.run(), self.pulse.loop(), self.weights_loop(),
                                                    self.way_out.watch_stop_key(), self.outbox.run())]
        try:
            await self.leaser.until_stopped()
            if self.auth_failure is not None:
                raise self.auth_failure
            self.leave_deadline = (self.leaving.since or time.monotonic()) + self.leaving.timeout_s
            await self.way_out.drain()
        finally:
            if self.leave_deadline is None:  # a failure: the same bounds on the way out
                self.leave_deadline = time.monotonic() + self.leaving.timeout_s
            await self.way_out.close(helpers)
            self.leaving.cancel()


class _SignalledDuringStart(SystemExit):
    """SIGTERM/SIGINT before the generator joined the fleet (engine start-up: model load, warm-up):
    nothing of it is in the fleet yet, so it leaves at once, cleanly. A SystemExit, so that asyncio
    lets it through from wherever the signal lands."""


def _leave_during_start(signum, _frame) -> None:
    raise _SignalledDuringStart(signal.Signals(signum).name)


def main(cfg: Config, generator_id: str, torch_unused: bool = False) -> None:
    """`torch_unused`: nothing in this process has computed with torch yet (vLLM on CPU may fork then)."""
    if torch_unused and cfg.generator.backend == "vllm":
        from generators import vllm_engine

        vllm_engine.TORCH_UNUSED = True
    # Until run() installs the drain on the event loop, a signal ends the start-up (exit 0) instead
    # of killing the process with it (-15) or a KeyboardInterrupt traceback.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _leave_during_start)
    try:
        import uvloop

        new_loop = uvloop.new_event_loop
    except ImportError:
        new_loop = asyncio.new_event_loop
    code = 0
    try:
        # Not asyncio.run: its teardown waits for every leftover task and executor thread, without a
        # bound; a generator that has left (heartbeat deleted, outbox drained, engine shut down) was
        # seen to hang there under load. Nothing is left to clean up once run() has returned.
        loop = new_loop()
        loop.run_until_complete(Generator(cfg, generator_id).run())
        leftover = [t.get_coro().__qualname__ for t in asyncio.all_tasks(loop) if not t.done()]
        threads = [t.name for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
        if leftover or threads:
            log.info("generator %s exits past leftover tasks=%s non-daemon threads=%s", generator_id, leftover, threads)
    except _SignalledDuringStart as e:
        log.info("generator %s: %s during start-up: left before joining the fleet", generator_id, e)
    except BaseException:  # noqa: BLE001 - printed in full, then a non-zero exit
        traceback.print_exc()
        code = 1
    # A non-daemon thread left by a library could also keep the interpreter from exiting: end the
    # process here, and with it any process the engine left (after a crash its core is still up).
    # Should even the flushing below hang, say where and exit.
    faulthandler.dump_traceback_later(30, exit=True)
    if killed := kill_children():
        log.warning("generator %s: ended %d leftover child process(es) %s", generator_id, len(killed), killed)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
