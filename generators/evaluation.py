"""The generator's side of periodic evaluation: lease eval prompts first, score, report.

Eval tasks share the generator's concurrency cap (`generator.max_concurrent_groups`) and its engine
with training groups, so an eval round slows training a little but never stops it; it produces no
trajectory. See asyncrl/tasks/evaluation.py for the protocol. A task marked `show` also gets its greedy
answer's text back (for `asyncrl report`): one decode of a few prompts per round.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from asyncrl.observe.inspection import episode_turns
from asyncrl.protocol import schema
from asyncrl.tasks.data import encode_prompt
from asyncrl.tasks.evaluation import EVAL_GROUP, eval_prompts_key, eval_results_key
from asyncrl.tasks.rewards import is_correct
from generators.episodes import episode_start, run_episode

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the lease loop looks at the eval stream (it is read without blocking)
RESULTS_MAXLEN = 100_000


class EvalWorker:
    def __init__(self, gen):
        self.gen = gen
        self.prompts_key = eval_prompts_key(gen.cfg.run.name)
        self.results_key = eval_results_key(gen.cfg.run.name)
        self._group_ready = False
        self._last_poll = 0.0
        self._last_claim = time.monotonic()
        self.num_done = 0

    async def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            await self.gen.redis.xgroup_create(self.prompts_key, EVAL_GROUP, id="0", mkstream=True)
        except aioredis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def lease(self, free: int) -> int:
        """Leases up to `free` eval tasks and starts them in the generator's in-flight set; returns how many."""
        now = time.monotonic()
        if free <= 0 or now - self._last_poll < POLL_S:
            return 0
        self._last_poll = now
        await self._ensure_group()
        entries = []
        # A generator that died holding eval tasks: take them over after the lease timeout.
        lease_s = self.gen.cfg.buffer.lease_timeout_s
        if now - self._last_claim > min(5.0, lease_s / 2):
            self._last_claim = now
            reply = await self.gen.redis.xautoclaim(self.prompts_key, EVAL_GROUP, self.gen.id,
                                                    int(lease_s * 1000), start_id="0-0", count=free)
            entries += [(e, f) for e, f in reply[1] if f]
        if len(entries) < free:
            reply = await self.gen.redis.xreadgroup(EVAL_GROUP, self.gen.id, {self.prompts_key: ">"},
                                                    count=free - len(entries))
            if reply:
                entries += reply[0][1]
        started = 0
        for entry_id, fields in entries:
            try:
                task = schema.decode(fields[b"data"], schema.EvalTask)
            except (schema.FrameError, KeyError) as e:
                log.error("bad eval entry %s: %s", entry_id, e)
                await self.gen.redis.xack(self.prompts_key, EVAL_GROUP, entry_id)
                continue
            t = asyncio.create_task(self.process(entry_id, task))
            self.gen.inflight.add(t)
            t.add_done_callback(self.gen._done)
            started += 1
        return started

    async def process(self, entry_id: bytes, task: schema.EvalTask) -> None:
        gen = self.gen
        # Evaluate the version the round names: wait for its weights (a newer version is fine too).
        while gen.version < task.version and not gen.stopping.is_set():
            await asyncio.sleep(0.05)
        greedy_episode = greedy_text = None
        if gen.env_factory is not None:
            (greedy_reward, greedy_correct), *scored, versions, num_tokens, greedy_episode = await self._episodes(task)
            if task.show:
                greedy_text = "\n".join(f"[{t['role']}] {t['text']}" for t in
                                        episode_turns(gen.tokenizer, greedy_episode.token_ids, greedy_episode.mask))
        else:
            (greedy_reward, greedy_correct), *scored, versions, num_tokens, greedy_ids = await self._completions(task)
            if task.show:
                greedy_text = gen.tokenizer.decode(greedy_ids, skip_special_tokens=True)
        result = schema.EvalResult(
            schema_version=schema.SCHEMA_VERSION, round_id=task.round_id, version=task.version,
            prompt_id=task.prompt_id, generator_id=gen.id, greedy_correct=greedy_correct,
            greedy_reward=greedy_reward, sample_correct=schema.pack_i32([int(c) for _, c in scored]),
            sample_rewards=schema.pack_f32([r for r, _ in scored]), min_version=int(min(versions or [gen.version])),
            num_tokens=num_tokens, finished_at=time.time(),
            greedy_turns=greedy_episode.turns if greedy_episode else 0,
            greedy_tool_calls=greedy_episode.tool_calls if greedy_episode else 0, greedy_text=greedy_text)
        async with gen.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.results_key, {"data": schema.encode(result)}, maxlen=RESULTS_MAXLEN, approximate=True)
            pipe.xack(self.prompts_key, EVAL_GROUP, entry_id)
            await pipe.execute()
        self.num_done += 1

    async def _completions(self, task: schema.EvalTask) -> list:
        """One greedy completion and `task.k` sampled ones, scored by the reward: [(reward, correct) of
        each, greedy first; then every token's version; then the tokens generated; then the greedy
        completion's token ids]."""
        gen = self.gen
        prompt_ids = encode_prompt(gen.tokenizer, task.prompt, gen.cfg.data.chat_template)
        jobs = [gen.engine.generate_group(prompt_ids, 1, lambda: gen.version, temperature=0.0)]
        if task.k > 0:
            jobs.append(gen.engine.generate_group(prompt_ids, task.k, lambda: gen.version))
        outs = await asyncio.gather(*jobs)
        every = [outs[0][0], *(outs[1] if task.k > 0 else [])]
        scored = await gen.rewards.call(lambda: [self.score(s.token_ids, task) for s in every])  # reward threads
        return [*scored, [v for s in every for v in s.versions], sum(len(s.token_ids) for s in every),
                outs[0][0].token_ids]

    async def _episodes(self, task: schema.EvalTask) -> list:
        """A task with an environment: one episode of greedy turns and `task.k` at the training
        temperature (generators/episodes.py), each scored by its environment's summed reward and correct
        where that reward is at least 1; the same list as `_completions`, then the greedy episode."""
        gen = self.gen
        row, prompt_ids = episode_start(gen, task)
        episodes = await asyncio.gather(*(
            run_episode(gen.engine, gen.codec, gen.env_factory(gen.cfg, row), prompt_ids, lambda: gen.version,
                        gen.episode_limits, temperature=t) for t in [0.0] + [None] * task.k))
        scored = [(float(ep.reward), ep.reward >= 1.0 - 1e-6) for ep in episodes]
        versions = [v for ep in episodes for v, m in zip(ep.versions, ep.mask, strict=True) if m]
        return [*scored, versions, sum(len(ep.token_ids) for ep in episodes), episodes[0]]

    def score(self, token_ids: list[int], task: schema.EvalTask) -> tuple[float, bool]:
        text = self.gen.tokenizer.decode(token_ids, skip_special_tokens=True)
        try:
            return float(self.gen.reward_fn(text, task.answer)), is_correct(self.gen.reward_fn, text, task.answer)
        except Exception as e:  # a user reward function must never take the generator down
            log.warning("reward error on eval prompt=%s: %r", task.prompt_id, e)
            return 0.0, False
