"""What a step's multi-turn episodes did (docs/agentic.md, docs/metrics.md): the learner adds these to
its step row when the step's groups are episodes (schema version 3)."""

from __future__ import annotations

from collections import Counter


def episode_metrics(groups) -> dict[str, float]:
    """Per-episode means of turns, tool calls, tool errors and environment seconds; environment seconds
    per step (turn); the share of each end reason; the share of tokens that are the policy's; and the
    policy version span inside one episode (an episode may span weight updates). Empty for a step
    without episodes."""
    import numpy as np

    from asyncrl.protocol.schema import unpack_i32

    samples = [s for g in groups for s in g.samples if s.episode is not None]
    if not samples:
        return {}
    n = len(samples)
    turns = sum(s.episode.turns for s in samples)
    env_s = sum(s.episode.env_s for s in samples)
    tokens = sum(s.num_tokens for s in samples)
    out = {
        "episode/turns_mean": turns / n,
        "episode/turns_max": float(max(s.episode.turns for s in samples)),
        "episode/tool_calls_mean": sum(s.episode.tool_calls for s in samples) / n,
        "episode/tool_errors_mean": sum(s.episode.tool_errors for s in samples) / n,
        "episode/env_s_mean": env_s / n,
        "episode/env_s_per_step": env_s / max(turns, 1),
        "episode/tokens_mean": tokens / n,
        "episode/policy_token_frac": sum(s.num_policy_tokens for s in samples) / max(tokens, 1),
        "episode/solved_frac": sum(1 for s in samples if s.reward > 0) / n,
        "episode/version_span_max": float(max(int(np.ptp(unpack_i32(s.versions))) for s in samples)),
    }
    reasons = Counter(s.episode.end_reason.split(":")[0] for s in samples)
    out.update({f"episode/end_{reason}_frac": count / n for reason, count in sorted(reasons.items())})
    return out
