"""Sampling settings: truncation is rejected for the off-policy losses unless allowed; the learner and
generators refuse to start next to each other when temperature/top-p/top-k disagree (real Redis)."""

import asyncio

import pytest

from asyncrl.config import ConfigError
from asyncrl.protocol import sampling
from asyncrl.protocol.keys import Keys, aconnect, connect


def test_truncated_sampling_rejected_unless_allowed(make_cfg):
    for override in ("generator.top_p=0.9", "generator.top_k=20"):
        with pytest.raises(ConfigError, match="allow_truncated_sampling"):
            make_cfg(override)
        cfg = make_cfg(override, "algorithm.allow_truncated_sampling=true")
        assert (cfg.generator.top_p, cfg.generator.top_k) != (1.0, -1)


def test_start_checks_both_ways(make_cfg, redis_server):
    learner_cfg = make_cfg(redis=redis_server)
    keys = Keys(learner_cfg.run.name)
    client = connect(redis_server.url)
    # A generator that is already running with another temperature stops the learner from starting.
    client.hset(keys.gen("g0"), mapping={"id": "g0", **sampling.heartbeat_fields(
        make_cfg("generator.temperature=0.7").generator)})
    with pytest.raises(sampling.SamplingMismatch, match=r"g0 \(generator.temperature=0.7"):
        sampling.check_fleet(client, keys, learner_cfg.generator)
    client.hset(keys.gen("g0"), mapping=sampling.heartbeat_fields(learner_cfg.generator))
    sampling.check_fleet(client, keys, learner_cfg.generator)  # agreeing fleet: no error
    sampling.publish(client, keys, learner_cfg.generator)

    async def generator_side(cfg):
        redis = await aconnect(redis_server.url)
        try:
            await sampling.check_generator(redis, keys, cfg.generator, "g1")
        finally:
            await redis.aclose()

    asyncio.run(generator_side(make_cfg()))
    with pytest.raises(sampling.SamplingMismatch, match="generator.temperature=1.0"):
        asyncio.run(generator_side(make_cfg("generator.temperature=0.5")))
