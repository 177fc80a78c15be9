"""Sampling consistency between the learner and the generators, checked when a process starts.

Why: the learner's loss divides by behaviour log-probs μ that the generators computed under their own
temperature / top-p / top-k. If the two sides disagree, every importance weight is off by a factor
nobody sees, and training quietly diverges. So the learner publishes its settings in Redis
(`sampling`) at start, and:

- a generator whose config disagrees with the published settings refuses to start;
- the learner refuses to start when a live generator's heartbeat reports different settings.

Groups carry their SamplingInfo as well, checked against the run's settings at the buffer's ingest
and before the learner trains (asyncrl/protocol/schema.py `validate_for_run`), which catches a
generator that changed after both had started.
"""

from __future__ import annotations

import json

from asyncrl.protocol.keys import Keys

FIELDS = ("temperature", "top_p", "top_k")


class SamplingMismatch(RuntimeError):
    """The learner and a generator were started with different sampling settings."""


def settings(generator_cfg) -> dict:
    """The settings that shape behaviour log-probs, from a `generator` config section."""
    return {"temperature": float(generator_cfg.temperature), "top_p": float(generator_cfg.top_p),
            "top_k": int(generator_cfg.top_k)}


def heartbeat_fields(generator_cfg) -> dict:
    """The heartbeat's fields (`sampling_temperature`, ...: asyncrl/protocol/schema.py `Heartbeat`) a generator reports."""
    return {f"sampling_{k}": v for k, v in settings(generator_cfg).items()}


def _describe(s: dict) -> str:
    return " ".join(f"generator.{k}={s[k]}" for k in FIELDS)


def _differs(a: dict, b: dict) -> bool:
    return any(float(a[k]) != float(b[k]) for k in FIELDS)


def publish(client, keys: Keys, generator_cfg) -> None:
    """Learner rank 0 at start: the settings every generator of this run must use."""
    client.set(keys.sampling, json.dumps(settings(generator_cfg)))


async def check_generator(redis, keys: Keys, generator_cfg, generator_id: str) -> None:
    """A generator at start: raises SamplingMismatch when the learner published other settings."""
    raw = await redis.get(keys.sampling)
    if raw is None:  # no learner yet: it checks our heartbeat when it starts
        return
    want, have = json.loads(raw), settings(generator_cfg)
    if _differs(want, have):
        raise SamplingMismatch(
            f"generator {generator_id} refuses to start: it is configured with {_describe(have)} but the "
            f"learner of run {keys.run!r} samples with {_describe(want)}. Behaviour log-probs would not match "
            "the learner's, and training would silently diverge: pass the same generator.* settings to every "
            "process of the run")


def check_fleet(client, keys: Keys, generator_cfg) -> None:
    """The learner at start: raises SamplingMismatch when a live generator reports other settings."""
    from asyncrl.protocol.fleet import read_fleet

    have = settings(generator_cfg)
    bad = []
    for gid, hb in sorted(read_fleet(client, keys).items()):
        reported = {k: getattr(hb, f"sampling_{k}") for k in FIELDS}
        if None in reported.values():
            continue  # heartbeat from a generator that does not report its settings (older build)
        if _differs(reported, have):
            bad.append(f"{gid} ({_describe(reported)})")
    if bad:
        raise SamplingMismatch(
            f"learner refuses to start: it is configured with {_describe(have)} but live generators sample "
            f"differently: {'; '.join(bad)}. Behaviour log-probs would not match the learner's: stop them or "
            "restart them with the learner's generator.* settings")
