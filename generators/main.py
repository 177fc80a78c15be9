"""`asyncrl generator CONFIG --id g0`: lease prompts, sample groups, score, push each group at once.

State machine: `waiting_weights` (holds no current version: generates nothing) -> `generating`
<-> `syncing`; SIGTERM -> `draining` (no new leases, in-flight groups finish and are pushed) -> gone.

Leaving (SIGTERM or SIGINT, Redis up or down): the process is gone within
`generator.drain_timeout_s` + LEAVE_MARGIN_S of the signal. In-flight groups get until
`drain_timeout_s`; what is unfinished then is cancelled and its prompts handed back; ingest
confirmations and the weight-group leave get what is left of the margin but LEAVE_RESERVE_S, which
is kept for the leave record in Redis and the engine's shutdown. Every Redis call on the way out is
bounded (EXIT_REDIS_S, and the leave deadline, asyncrl/launch/leaving.py): once Redis has not answered,
the remaining Redis steps are skipped and one line says what was left to the buffer's reclaimer
(leased prompts come back when their leases expire, buffer.lease_timeout_s). The exit code is 0
when the generator left by itself (in time, Redis up or down), 143 when the leave timer had to end
it, 1 after a failure.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback

import zmq.asyncio
from redis.exceptions import RedisError

from asyncrl.config import Config
from asyncrl.modes import may_generate
from asyncrl.protocol import fleet, notify, retry, schema, security
from asyncrl.protocol.keys import PROMPT_GROUP, Keys, aconnect
from asyncrl.protocol.notify import AsyncNotifications
from asyncrl.protocol.sampling import heartbeat_fields
from asyncrl.tasks.data import encode_prompt
from asyncrl.tasks.rewards import RewardPool, build_reward
from generators.drain import hand_back
from generators.evaluation import EvalWorker
from generators.outbox import GroupOutbox

log = logging.getLogger(__name__)

# Waits end at once on a wake-up from the notify stream (asyncrl/protocol/notify.py); these bound them, so a
# lost wake-up (Redis restart, a writer that does not publish one) costs at most this long.
WEIGHTS_FALLBACK_S = 0.5  # re-read wgroup/wsync
VERSION_FALLBACK_S = 0.5  # run.mode=sync: re-read the learner's version
PROMPTS_FALLBACK_S = 0.1  # run.mode=sync: re-read the prompt stream (and the eval stream with it)

LEAVE_MARGIN_S = 15.0  # past generator.drain_timeout_s: hand-back, confirmations, weight group, engine shutdown
LEAVE_RESERVE_S = 8.0  # of the margin, kept for the leave record and the engine's shutdown (vLLM: up to ~5 s)
EXIT_REDIS_S = 2.0  # one Redis call on the way out; not answered by then, Redis counts as unreachable


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
        self.redis_lost: str | None = None  # on the way out: the step at which Redis did not answer
        self.skipped: list[str] = []  # Redis steps of the way out skipped because of that
        self.tokens = 0  # of the pushed groups' samples (what the learner trains on)
        self.baseline_tokens = 0  # of the greedy completions that give advantage=remax its baselines
        self.groups = 0
        self.reward_errors = 0
        self.idle_s = 0.0
        self.sync_s_total = 0.0
        self.last_pause_s = 0.0
        self.num_syncs = 0
        self.started = time.monotonic()
        from asyncrl.observe.metrics import FleetTokenRate

        self._rate_window, self._rate = FleetTokenRate(start=self.started), 0.0
        self.last_checksums: list[int] = []
        from asyncrl.registry import ADVANTAGES

        self.greedy_baseline = bool(ADVANTAGES.static_meta(cfg.algorithm.advantage).get("greedy_baseline"))
        from asyncrl.tasks.registry import get_task

        # A task with an environment is played as multi-turn episodes (generators/episodes.py).
        self.env_factory = get_task(cfg.data.task).environment
        self.episode_stats = {"episodes": 0, "turns": 0, "tool_calls": 0, "tool_errors": 0, "env_s": 0.0}
        self.sampling = schema.SamplingInfo(temperature=cfg.generator.temperature, top_p=cfg.generator.top_p,
                                            top_k=cfg.generator.top_k)
        from asyncrl.observe.selfwatch import SelfWatch

        # Its own stall check (asyncrl/observe/selfwatch.py), reported in its heartbeat: no launcher needed.
        self.watch = SelfWatch(f"generator:{generator_id}", cfg.run.stall_timeout_s)
        self._watched_groups = 0

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

    # ---- heartbeat and weights -----------------------------------------------------------------

    async def heartbeat(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-6)
        # tokens/s over the last 30 s (since start before that), not over one
        # heartbeat interval (the counter moves when a group finishes: most intervals would read 0)
        self._rate = self._rate_window.update({self.id: self.tokens}, now)
        await self._watch_progress()
        proof = ""
        if (token := security.run_token(self.cfg)) is not None:  # the learner ignores generators without it
            proof = security.token_proof(token, self.id)
        fields = schema.Heartbeat(
            id=self.id, state=self.state, version=self.version, epoch=self.epoch, workers=self.engine.num_workers,
            tokens=self.tokens, baseline_tokens=self.baseline_tokens, groups=self.groups, tokens_per_s=self._rate,
            idle_ratio=self.idle_s / elapsed, idle_s=round(self.idle_s, 3), reward_errors=self.reward_errors,
            sync_s_total=self.sync_s_total, last_pause_s=self.last_pause_s, num_syncs=self.num_syncs,
            **heartbeat_fields(self.cfg.generator), checksums=list(self.last_checksums), pid=os.getpid(),
            host=socket.gethostname(), node=fleet.node_id(), updated_at=time.time(), schema_version=schema.SCHEMA_VERSION,
            token_proof=proof, **self.watch.fields()).to_hash()
        key = self.keys.gen(self.id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, int(self.cfg.generator.heartbeat_ttl_s))
            await pipe.execute()
        if (exporter := getattr(self, "exporter", None)) is not None:  # started in start()
            exporter.update(fields)

    async def _watch_progress(self) -> None:
        """Progress is a group pushed; a wait past run.stall_timeout_s is reported once (log, event,
        heartbeat) with what it waits on, read from this generator's own state."""
        if self.groups != self._watched_groups:
            self._watched_groups = self.groups
            if (done := self.watch.progress()) is not None:
                await self.redis.xadd(self.keys.events, {"kind": "stall_resolved", "role": done.role, "what": done.what,
                                                         "t": f"{time.time():.3f}"}, maxlen=10_000, approximate=True)
            return
        if self.state in ("starting", "draining"):
            self.watch.hold()
            return
        if (stall := self.watch.check("no_group", self._wait_reason)) is not None:
            await self.redis.xadd(self.keys.events, {"kind": "stall", "role": stall.role, "what": stall.what,
                                                     "since_s": f"{stall.since_s:.1f}", "reason": stall.reason,
                                                     "source": "self", "t": f"{time.time():.3f}"},
                                  maxlen=10_000, approximate=True)

    def _wait_reason(self) -> str:
        if self.version < 0:
            return "waiting for weights: it holds no policy version until the learner's next broadcast reaches it"
        unconfirmed = len(getattr(self, "outbox", ()) or ())
        if unconfirmed:
            return (f"waiting for the buffer: {unconfirmed} pushed groups not confirmed as ingested (is the buffer "
                    "up, or full?)")
        if self.inflight:
            return f"waiting for the engine: {len(self.inflight)} groups in generation, none finished"
        return "waiting for prompts: none to lease (the buffer released none: its admission budget waits on the learner)"

    async def heartbeat_loop(self) -> None:
        while True:
            await self.heartbeat()
            await asyncio.sleep(self.cfg.generator.heartbeat_s)

    async def weights_loop(self) -> None:
        """Follows the learner's group epochs and weight announcements: re-read at each `weights`
        wake-up (the learner publishes one with every wgroup/wsync change), else every WEIGHTS_FALLBACK_S."""
        last_ann = None
        while True:
            seen = self.notes.seen(("weights",))
            try:
                last_ann = await self._follow_weights(last_ann)
            except Exception as e:  # a failed join/receive: hold no version until the next good sync
                log.error("generator %s weight sync failed: %r; waiting for the next epoch", self.id, e)
                self.version, self.epoch = -1, -1
                await self.redis.xadd(self.keys.events, {"kind": "sync_failed", "id": self.id, "error": repr(e),
                                                         "t": f"{time.time():.3f}"})
            await self.notes.wait(("weights",), seen, WEIGHTS_FALLBACK_S)

    async def _follow_weights(self, last_ann):
        w = self.cfg.weights
        epoch_frame, ann_frame = await self.redis.mget(self.keys.wgroup, self.keys.wsync)  # one round trip
        if epoch_frame:
            info = schema.decode(epoch_frame, schema.GroupEpoch)
            if info.epoch > self.epoch and any(m.startswith(f"{self.id}.") for m in info.members):
                t0 = time.monotonic()
                ok = await self.engine.join(epoch_frame, self.id, w.join_timeout_s)
                if ok:
                    self.epoch = info.epoch
                log.info("generator %s join epoch=%d ok=%s (%.2fs)", self.id, info.epoch, ok, time.monotonic() - t0)
                ann_frame = await self.redis.get(self.keys.wsync)  # may have moved on while we joined
        if not ann_frame or self.epoch < 0:
            return last_ann
        ann = schema.decode(ann_frame, schema.WeightAnnouncement)
        ident = (ann.epoch, ann.version, ann.announced_at)
        # Every announcement of our epoch is a broadcast we must take part in, even one of a version
        # we already hold: the learner's broadcast waits for all members.
        if ann.epoch != self.epoch or ident == last_ann:
            return last_ann
        prev, self.state = self.state, "syncing"
        await self.heartbeat()
        stats = await self.engine.update_weights(ann_frame, w.mode, w.sync_timeout_s)
        self.version = ann.version
        self.notes.bump("held")  # sync mode's lease loop waits for this
        self.last_checksums = stats["checksums"]
        self.sync_s_total += stats["pause_s"]
        self.last_pause_s, self.num_syncs = stats["pause_s"], self.num_syncs + 1
        await self.redis.xadd(self.keys.events, {"kind": "generator_sync", "id": self.id, "version": ann.version,
                                                 "mode": w.mode, "pause_s": f"{stats['pause_s']:.4f}",
                                                 "wake_s": f"{stats.get('wake_s', 0.0):.4f}",
                                                 "t": f"{time.time():.3f}"}, maxlen=10_000, approximate=True)
        if self.state == "syncing":  # a drain that began during the update keeps "draining"
            self.state = prev if prev in ("draining", "generating") else "generating"
        await self.heartbeat()
        await notify.publish(self.redis, self.keys, "fleet")  # the buffer's admission counts from it
        ipc = (f"; ipc handle {stats['handle_s']:.3f}s, checksums {stats['checksum_s']:.3f}s, "
               f"confirm {stats['finish_s']:.3f}s" if stats.get("handle_s") else "")
        log.info("generator %s now at version %d (pause %.3fs: to pause %.3fs, load %.3fs by %s%s; transfer before "
                 "it %.3fs; wake %.3fs)", self.id, self.version, stats["pause_s"], stats.get("wait_s", 0.0),
                 stats.get("load_s", stats.get("receive_s", 0.0)), stats.get("load_path", "reload"), ipc,
                 stats.get("stage_s", 0.0),
                 stats.get("wake_s", 0.0))
        return ident

    # ---- generation ----------------------------------------------------------------------------

    async def process(self, entry_id: bytes, task: schema.PromptTask) -> None:
        # run.mode=sync: a prompt leased just before the learner's version moved waits for its weights.
        while self.cfg.run.mode == "sync":
            seen = self.notes.seen(("version", "held"))
            if may_generate("sync", self.version, await self._learner_version()):
                break
            await self.notes.wait(("version", "held"), seen, VERSION_FALLBACK_S)
        if self.env_factory is not None:
            self._push(entry_id, task, await self._episodes(task))
            return
        prompt_ids = encode_prompt(self.tokenizer, task.prompt, self.cfg.data.chat_template)
        row = {"prompt": task.prompt, "prompt_id": task.prompt_id, "group_id": task.group_id}
        sampled = self.engine.generate_group(prompt_ids, self.cfg.generator.n, lambda: self.version)
        baseline = None
        if self.greedy_baseline:
            outs, baseline = await asyncio.gather(sampled, self._greedy_baseline(prompt_ids, task, row))
        else:
            outs = await sampled
        texts = [self.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs]
        # On the reward threads; errors are caught per sample (asyncrl/tasks/rewards.py), counted and logged.
        rewards, errors = await self.rewards.score(texts, task.answer, row)
        samples = []
        for out, reward in zip(outs, rewards, strict=True):
            samples.append(schema.Sample(completion_ids=schema.pack_i32(out.token_ids),
                                         logprobs=schema.pack_f32(out.logprobs),
                                         versions=schema.pack_i32(out.versions), reward=reward,
                                         finish_reason=out.finish_reason))
        group = schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=task.group_id,
                                       prompt_id=task.prompt_id, generator_id=self.id,
                                       prompt_ids=schema.pack_i32(prompt_ids), samples=samples,
                                       sampling=self.sampling, created_at=time.time(), reward_errors=errors,
                                       baseline_reward=baseline)
        self._push(entry_id, task, group)

    def _push(self, entry_id: bytes, task: schema.PromptTask, group: schema.TrajectoryGroup) -> None:
        # The outbox sends it and acks the prompt once the buffer has ingested the group: a crash
        # (ours or the buffer's) before that leaves the prompt to be re-sent or re-leased.
        self.outbox.put(task.group_id, entry_id, schema.encode(group))
        self.tokens += group.num_tokens()
        self.groups += 1
        self.reward_errors += group.reward_errors

    async def _episodes(self, task: schema.PromptTask) -> schema.TrajectoryGroup:
        """generator.n episodes of the prompt's row, concurrently (each turn a request of its own to the
        engine, which batches them with every other episode's), as one group of schema version 3."""
        from asyncrl.tasks.synthetic import PromptRecord
        from generators.episodes import run_episode

        row = PromptRecord(prompt_id=task.prompt_id, prompt=task.prompt, answer=task.answer)
        system = self.cfg.env.system_prompt or getattr(self.env_factory, "system_prompt", "")
        prompt_ids = self.codec.prompt_ids(system, task.prompt)
        episodes = await asyncio.gather(*(run_episode(self.engine, self.codec, self.env_factory(self.cfg, row), prompt_ids,
                                                      lambda: self.version, self.episode_limits)
                                          for _ in range(self.cfg.generator.n)))
        samples = []
        for ep in episodes:
            samples.append(schema.Sample(
                completion_ids=schema.pack_i32(ep.token_ids), logprobs=schema.pack_f32(ep.logprobs),
                versions=schema.pack_i32(ep.versions), reward=ep.reward, finish_reason=ep.finish_reason,
                loss_mask=bytes(ep.mask),
                episode=schema.EpisodeInfo(turns=ep.turns, tool_calls=ep.tool_calls, tool_errors=ep.tool_errors,
                                           env_s=round(ep.env_s, 6), end_reason=ep.end_reason)))
            for k in ("turns", "tool_calls", "tool_errors", "env_s"):
                self.episode_stats[k] += getattr(ep, k)
            self.episode_stats["episodes"] += 1
        return schema.TrajectoryGroup(schema_version=schema.EPISODE_SCHEMA_VERSION, group_id=task.group_id,
                                      prompt_id=task.prompt_id, generator_id=self.id,
                                      prompt_ids=schema.pack_i32(prompt_ids), samples=samples,
                                      sampling=self.sampling, created_at=time.time())

    async def _greedy_baseline(self, prompt_ids: list[int], task: schema.PromptTask, row: dict) -> float:
        """advantage=remax: the reward of one greedy completion of the prompt (same max_tokens, same
        reward function as the samples), generated beside them. It is not a sample: its tokens are
        counted as `baseline_tokens`, not as the group's. A reward error scores it 0.0, as it does a
        sample, and is counted with the generator's reward errors."""
        (greedy,) = await self.engine.generate_group(prompt_ids, 1, lambda: self.version, temperature=0.0)
        text = self.tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
        (reward,), errors = await self.rewards.score([text], task.answer, row)
        self.baseline_tokens += len(greedy.token_ids)
        self.reward_errors += errors
        return reward

    def _done(self, task: asyncio.Task) -> None:
        self.inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("group failed: %r", task.exception())
            self.failure = task.exception()

    async def lease_loop(self) -> None:
        self.failure = None
        cap = self.cfg.generator.max_concurrent_groups
        while not self.stopping.is_set():
            if self.failure is not None:
                raise self.failure
            if self.version < 0:
                self.state = "waiting_weights"
                t0, seen = time.monotonic(), self.notes.seen(("held",))
                await self.notes.wait(("held",), seen, 0.1)
                self.idle_s += time.monotonic() - t0
                continue
            if self.cfg.run.mode == "sync" and not await self._lockstep_turn():
                continue
            if self.state != "syncing":
                self.state = "generating"
            # Groups waiting in the outbox for ingest confirmation no longer use the engine; they count
            # only past `cap` of them, so a stalled or full buffer still stops leasing (backpressure).
            free = cap - len(self.inflight) - max(0, len(self.outbox) - cap)
            if free <= 0:
                await asyncio.sleep(0.01)
                continue
            free -= await self.evals.lease(free)  # eval tasks have priority over training prompts
            if free <= 0:
                continue
            t0 = time.monotonic()
            # run.mode=sync reads without blocking: a blocked read would lease the next version's prompts
            # before this generator holds its weights (they would wait in process(), uncounted as idle).
            # Instead it waits for a wake-up (prompts released, the learner stepped) and re-checks the version.
            lockstep = self.cfg.run.mode == "sync"
            seen = self.notes.seen(("prompts", "version", "held"))
            reply = await self.redis.xreadgroup(PROMPT_GROUP, self.id, {self.keys.prompts: ">"}, count=free,
                                                block=None if lockstep else 200)
            if not reply:
                if lockstep:
                    await self._idle_if_done()  # this batch is done here: the learner steps next
                    await self.notes.wait(("prompts", "version", "held"), seen, PROMPTS_FALLBACK_S)
                if not self.inflight:
                    self.idle_s += time.monotonic() - t0
                continue
            for entry_id, fields in reply[0][1]:
                try:
                    task = schema.decode(fields[b"data"], schema.PromptTask)
                except (schema.FrameError, KeyError) as e:
                    log.error("bad prompt entry %s: %s", entry_id, e)
                    await self.redis.xack(self.keys.prompts, PROMPT_GROUP, entry_id)
                    continue
                t = asyncio.create_task(self.process(entry_id, task))
                self.inflight.add(t)
                t.add_done_callback(self._done)

    async def _idle_if_done(self) -> None:
        """run.mode=sync: tells the engine it idles (generator.sleep) once nothing is in flight and the
        outbox has handed every group to the buffer."""
        if not self.inflight and not len(self.outbox):
            await self.engine.idle()

    async def _learner_version(self) -> int:
        return int(await self.redis.get(self.keys.version) or 0)

    async def _lockstep_turn(self) -> bool:
        """run.mode=sync: lease only while holding the learner's current version (asyncrl/modes.py)."""
        seen = self.notes.seen(("version", "held"))
        if may_generate("sync", self.version, await self._learner_version()):
            return True
        t0 = time.monotonic()
        self.state = "waiting_weights"
        await self._idle_if_done()
        await self.notes.wait(("version", "held"), seen, VERSION_FALLBACK_S)
        if not self.inflight:
            self.idle_s += time.monotonic() - t0
        return False

    async def stop_watch(self) -> None:
        while not self.stopping.is_set():
            if await self.redis.exists(self.keys.stop):
                self.run_over = True
                self.stopping.set()
            await asyncio.sleep(0.5)

    async def _leave_weight_group(self) -> None:
        """A drained generator stays for broadcasts until the learner has re-formed the weight group
        without it (draining members are left out of the next epoch): leaving in the middle of a
        broadcast would fail that sync for the other members (their receive is atomic, so they keep
        their weights, but they wait for the next epoch). Bounded by weights.join_timeout_s: the
        learner drops a draining member at its next sync or fleet check, well within that."""
        w = self.cfg.weights
        deadline = time.monotonic() + w.join_timeout_s
        while self.epoch >= 0 and time.monotonic() < deadline and not await self.redis.exists(self.keys.stop):
            frame = await self.redis.get(self.keys.wgroup)
            if not frame or not any(m.startswith(f"{self.id}.") for m in schema.decode(frame, schema.GroupEpoch).members):
                return
            await asyncio.sleep(0.1)

    async def _leave_finished_run(self) -> None:
        """The learner has finished (it set `stop`) and the buffer leaves with it: nothing generated
        now will be trained. Leave at once instead of draining: in-flight groups are cancelled and
        their prompts handed back (as a drain does with what it could not finish), unconfirmed ones
        are left. Draining waited on in-flight groups (up to generator.drain_timeout_s) and on ingest
        confirmations from a buffer that is gone (up to 60 s), which outlasted the launcher's grace:
        the generator was killed (seen in benchmark runs)."""
        in_flight, unconfirmed = len(self.inflight), len(self.outbox)
        if self.inflight:  # their leases go back at once: a resumed run need not wait for the reclaimer
            await self._hand_back("the run is over")
        if in_flight or unconfirmed:
            log.info("generator %s: the run is over; leaving %d groups in flight and %d unconfirmed",
                     self.id, in_flight, unconfirmed)

    def _secure_socket(self, sock) -> bool:
        return security.secure_client_socket(self.cfg, sock)

    def _refused(self, error: Exception) -> None:
        """The buffer refused our run token / CURVE key: stop, and exit non-zero (run() re-raises)."""
        self.auth_failure = error
        self.stopping.set()

    # ---- leaving -------------------------------------------------------------------------------

    def _left_s(self, reserve_s: float = 0.0) -> float:
        """Seconds until the leave deadline less `reserve_s` (never negative)."""
        return max(self.leave_deadline - reserve_s - time.monotonic(), 0.0)

    async def _bounded(self, what: str, aw, limit_s: float = EXIT_REDIS_S, lost_on_timeout: bool = True):
        """One step of the way out that talks to Redis, ended at `limit_s` and at the leave deadline.
        A Redis error, or a timeout of a single call (`lost_on_timeout`), marks Redis unreachable:
        every later Redis step is skipped (a frozen redis-server would hold each for socket_timeout,
        a dead one for buffer.redis_retry_s), and so is this one when Redis was already lost."""
        if self.redis_lost is not None:
            aw.close()
            self.skipped.append(what)
            return None
        try:
            return await asyncio.wait_for(aw, timeout=min(limit_s, self._left_s()))
        except (TimeoutError, RedisError, OSError) as e:
            if lost_on_timeout or not isinstance(e, TimeoutError):
                self.redis_lost = f"{what}: {e!r}"
                self.skipped.append(what)
                retry.leave_by(time.monotonic())  # calls still retrying elsewhere give up now
            else:
                log.warning("generator %s: %s not done in time; leaving without it", self.id, what)
            return None

    async def _hand_back(self, why: str | None = None) -> None:
        """Cancels what is in flight and hands its prompts back (bounded); without Redis the leases
        are left to expire."""
        tasks = list(self.inflight)
        if self.redis_lost is not None:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.skipped.append("hand back")
            return
        await self._bounded("hand back", hand_back(self, *([why] if why else [])), lost_on_timeout=True)

    async def _lease_until_stopped(self) -> None:
        """The lease loop, until `stopping`: it sees that at its next turn (a lease read blocks at
        most 200 ms); one held in a Redis call under retry (Redis down) is cancelled after a second.
        A prompt leased by a cancelled read is handed back with the rest (generators/drain.py)."""
        lease = asyncio.create_task(self.lease_loop())
        stop = asyncio.create_task(self.stopping.wait())
        try:
            await asyncio.wait({lease, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not lease.done():
                await asyncio.wait({lease}, timeout=1.0)
        finally:
            stop.cancel()
            if not lease.done():
                lease.cancel()
            await asyncio.gather(lease, stop, return_exceptions=True)
        if lease.cancelled() or lease.exception() is None:
            return
        if self.stopping.is_set() and isinstance(lease.exception(), (RedisError, OSError)):
            return  # Redis was down while leaving: the way out handles that
        raise lease.exception()

    async def _announce_draining(self) -> None:
        """The heartbeat says "draining" from now on, which the learner reads as: leave this generator
        out of the next weight group. A weight update in progress keeps that state when it ends."""
        self.state = "draining"
        await self._bounded("heartbeat", self.heartbeat())

    async def _drain(self) -> None:
        """The way out after the lease loop stopped, within the leave deadline."""
        await self._announce_draining()
        if not self.run_over and self.redis_lost is None:  # a whole run's teardown sets `stop` first
            self.run_over = bool(await self._bounded("stop key", self.redis.exists(self.keys.stop)))
        if self.run_over:
            await self._leave_finished_run()
            return
        # Draining (SIGTERM: a scale-down): no new leases; what is in flight finishes and is pushed.
        if self.inflight:
            await asyncio.wait(self.inflight, timeout=self._left_s(LEAVE_MARGIN_S))
        if self.inflight:  # not done in time: hand their prompts back (generators/drain.py)
            await self._hand_back()
        if self.outbox.held:
            budget = self._left_s(LEAVE_RESERVE_S)
            await self._bounded("ingest confirmations", self.outbox.drain(timeout_s=budget), budget + 0.5,
                                lost_on_timeout=False)
            if self.outbox.held and self.redis_lost is None:
                log.warning("generator %s leaves %d groups unconfirmed; their prompts will be reclaimed",
                            self.id, len(self.outbox))
        if self.epoch >= 0:
            await self._bounded("weight group leave", self._leave_weight_group(), self._left_s(LEAVE_RESERVE_S),
                                lost_on_timeout=False)

    async def _goodbye(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.gen(self.id))
            pipe.xadd(self.keys.events, {"kind": "generator_leave", "id": self.id, "t": f"{time.time():.3f}"})
            await pipe.execute()

    async def run(self) -> None:
        from asyncrl.launch.leaving import Leaving

        self.auth_failure = None
        await self.start()
        self.leaving = Leaving(f"generator {self.id}", "generator.drain_timeout_s", self.cfg.generator.drain_timeout_s,
                               self.stopping.set, margin_s=LEAVE_MARGIN_S)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.leaving.on_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self.leaving.on_signal, signal.SIGINT)
        helpers = [asyncio.create_task(c) for c in (self.notes.run(), self.heartbeat_loop(), self.weights_loop(),
                                                    self.stop_watch(), self.outbox.run())]
        try:
            await self._lease_until_stopped()
            if self.auth_failure is not None:
                raise self.auth_failure
            self.leave_deadline = (self.leaving.since or time.monotonic()) + self.leaving.timeout_s
            await self._drain()
        finally:
            if self.leave_deadline is None:  # a failure: the same bounds on the way out
                self.leave_deadline = time.monotonic() + self.leaving.timeout_s
            for t in [*helpers, *self.inflight]:
                t.cancel()
            # Bounded: a helper inside a Redis call under retry may take a moment to see the cancel.
            pending = [*helpers, *self.inflight]
            _, stuck = (await asyncio.wait(pending, timeout=min(5.0, max(self._left_s(), 0.5)))) if pending else ((), ())
            if stuck:
                log.warning("generator %s: %d tasks did not stop in time; leaving anyway", self.id, len(stuck))
            await self._bounded("leave record", self._goodbye())
            self.outbox.close()
            self.ctx.term()
            self.rewards.shutdown()
            self.engine.shutdown()
            try:
                await asyncio.wait_for(self.redis.aclose(), timeout=1.0)
            except (TimeoutError, RedisError, OSError):
                pass
            if self.redis_lost is not None:
                log.warning("generator %s left without Redis (unreachable at %s): skipped %s; %d unconfirmed groups "
                            "and any leased prompts come back when their leases expire (buffer.lease_timeout_s=%.0f)",
                            self.id, self.redis_lost, ", ".join(self.skipped), len(self.outbox),
                            self.cfg.buffer.lease_timeout_s)
            log.info("generator %s left: groups=%d tokens=%d baseline_tokens=%d", self.id, self.groups, self.tokens,
                     self.baseline_tokens)
            self.leaving.cancel()


def main(cfg: Config, generator_id: str) -> None:
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
    except BaseException:  # noqa: BLE001 - printed in full, then a non-zero exit
        traceback.print_exc()
        code = 1
    # A non-daemon thread left by a library could also keep the interpreter from exiting: end the
    # process here. Should even the flushing below hang, say where and exit.
    faulthandler.dump_traceback_later(30, exit=True)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
