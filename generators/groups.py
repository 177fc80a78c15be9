"""One leased prompt into one trajectory group: `generator.n` completions sampled by the engine (or,
for a task with an environment, `generator.n` multi-turn episodes, generators/episodes.py), scored
on the reward threads, and put in the outbox, which pushes it to the buffer.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from asyncrl.protocol import schema
from asyncrl.tasks.data import encode_prompt
from generators.episodes import episode_start, run_episode


class GroupSampler:
    def __init__(self, gen):
        self.gen = gen
        self.episode_stats = {"episodes": 0, "turns": 0, "tool_calls": 0, "tool_errors": 0, "env_s": 0.0}

    async def sample(self, entry_id: bytes, task: schema.PromptTask) -> None:
        gen = self.gen
        if gen.env_factory is not None:
            self._push(entry_id, task, await self._episodes(task))
            return
        prompt_ids = encode_prompt(gen.tokenizer, task.prompt, gen.cfg.data.chat_template)
        row = {"prompt": task.prompt, "prompt_id": task.prompt_id, "group_id": task.group_id}
        sampled = gen.engine.generate_group(prompt_ids, gen.cfg.generator.n, lambda: gen.version)
        baseline = None
        if gen.greedy_baseline:
            outs, baseline = await asyncio.gather(sampled, self._greedy_baseline(prompt_ids, task, row))
        else:
            outs = await sampled
        texts = [gen.tokenizer.decode(out.token_ids, skip_special_tokens=True) for out in outs]
        # On the reward threads; errors are caught per sample (asyncrl/tasks/rewards.py), counted and logged.
        rewards, errors = await gen.rewards.score(texts, task.answer, row)
        samples = []
        for out, reward in zip(outs, rewards, strict=True):
            samples.append(schema.Sample(completion_ids=schema.pack_i32(out.token_ids),
                                         logprobs=schema.pack_f32(out.logprobs),
                                         versions=schema.pack_i32(out.versions), reward=reward,
                                         finish_reason=out.finish_reason))
        group = schema.TrajectoryGroup(schema_version=schema.SCHEMA_VERSION, group_id=task.group_id,
                                       prompt_id=task.prompt_id, generator_id=gen.id,
                                       prompt_ids=schema.pack_i32(prompt_ids), samples=samples,
                                       sampling=gen.sampling, created_at=time.time(), reward_errors=errors,
                                       baseline_reward=baseline)
        self._push(entry_id, task, group)

    def _push(self, entry_id: bytes, task: schema.PromptTask, group: schema.TrajectoryGroup) -> None:
        # The outbox sends it and acks the prompt once the buffer has ingested the group: a crash
        # (ours or the buffer's) before that leaves the prompt to be re-sent or re-leased.
        gen = self.gen
        # The lease travels with the group: the buffer stores it only while that lease is pending.
        group = msgspec.structs.replace(group, lease_id=entry_id.decode())
        gen.outbox.put(task.group_id, entry_id, schema.encode(group))
        gen.tokens += group.num_tokens()
        gen.groups += 1
        gen.reward_errors += group.reward_errors

    async def _episodes(self, task: schema.PromptTask) -> schema.TrajectoryGroup:
        """generator.n episodes of the prompt's row, concurrently (each turn a request of its own to the
        engine, which batches them with every other episode's), as one group of schema version 3."""
        gen = self.gen
        row, prompt_ids = episode_start(gen, task)
        episodes = await asyncio.gather(*(run_episode(gen.engine, gen.codec, gen.env_factory(gen.cfg, row), prompt_ids,
                                                      lambda: gen.version, gen.episode_limits)
                                          for _ in range(gen.cfg.generator.n)))
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
                                      prompt_id=task.prompt_id, generator_id=gen.id,
                                      prompt_ids=schema.pack_i32(prompt_ids), samples=samples,
                                      sampling=gen.sampling, created_at=time.time())

    async def _greedy_baseline(self, prompt_ids: list[int], task: schema.PromptTask, row: dict) -> float:
        """advantage=remax: the reward of one greedy completion of the prompt (same max_tokens, same
        reward function as the samples), generated beside them. It is not a sample: its tokens are
        counted as `baseline_tokens`, not as the group's. A reward error scores it 0.0, as it does a
        sample, and is counted with the generator's reward errors."""
        gen = self.gen
        (greedy,) = await gen.engine.generate_group(prompt_ids, 1, lambda: gen.version, temperature=0.0)
        text = gen.tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
        (reward,), errors = await gen.rewards.score([text], task.answer, row)
        gen.baseline_tokens += len(greedy.token_ids)
        gen.reward_errors += errors
        return reward
