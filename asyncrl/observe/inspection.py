"""`asyncrl inspect CONFIG`: the newest trajectories, decoded, with behaviour vs current log-probs.

Reads the newest groups from the run's trajectories stream and prints, per sample, the decoded text,
its reward and, per token, the policy version that sampled it, the behaviour log-prob mu the
generator recorded and the log-prob under the Hugging Face weights at `model.path` (or `--model`),
computed with the run's sampling temperature. Large gaps between the two say the behaviour policy
and the weights you are looking at disagree (staleness, or a broken weight sync).
"""

from __future__ import annotations

import json

from asyncrl.config import Config
from asyncrl.protocol.keys import Keys, connect


def newest_groups(client, keys: Keys, num: int):
    from asyncrl.protocol import schema

    out = []
    for entry_id, fields in client.xrevrange(keys.trajectories, count=num):
        try:
            out.append((entry_id.decode(), schema.decode(fields[b"data"], schema.TrajectoryGroup)))
        except (schema.FrameError, KeyError) as e:
            out.append((entry_id.decode(), e))
    return out


def current_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> list[float]:
    import torch

    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / temperature
    lp = torch.log_softmax(logits, dim=-1)
    return lp.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def episode_turns(tok, ids: list[int], mask: list[int]) -> list[dict]:
    """A multi-turn episode's tokens as its turns: each run of the policy's tokens (mask 1) is an
    assistant turn, each run of the others an environment turn (its observation, in the template's
    framing)."""
    turns, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            turns.append({"role": "assistant" if mask[start] else "environment",
                          "text": tok.decode(ids[start:i], skip_special_tokens=True)})
            start = i
    return turns


def inspect_trajectories(cfg: Config, redis_url: str, num_groups: int = 2, max_samples: int = 2,
                         model_path: str | None = None, with_current: bool = True) -> list[dict]:
    from transformers import AutoTokenizer

    from asyncrl.protocol import schema

    client = connect(redis_url)
    path = model_path or cfg.model_path
    tok = AutoTokenizer.from_pretrained(path)
    model = None
    if with_current:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for entry_id, group in newest_groups(client, Keys(cfg.run.name), num_groups):
        if isinstance(group, Exception):
            out.append({"entry": entry_id, "error": str(group)})
            continue
        prompt_ids = schema.unpack_i32(group.prompt_ids).tolist()
        rec = {"entry": entry_id, "group_id": group.group_id, "generator": group.generator_id,
               "created_at": group.created_at, "prompt": tok.decode(prompt_ids), "samples": []}
        for s in group.samples[:max_samples]:
            ids = schema.unpack_i32(s.completion_ids).tolist()
            behav = schema.unpack_f32(s.logprobs).tolist()
            cur = current_logprobs(model, prompt_ids, ids, cfg.generator.temperature) if model else [None] * len(ids)
            mask = list(s.loss_mask) if s.loss_mask else [1] * len(ids)
            sample = {
                "text": tok.decode(ids, skip_special_tokens=True), "reward": s.reward,
                "finish_reason": s.finish_reason,
                "tokens": [{"token": tok.decode([t]), "id": t, "version": int(v), "policy": bool(m),
                            "behaviour_logprob": b, "current_logprob": c}
                           for t, v, m, b, c in zip(ids, schema.unpack_i32(s.versions).tolist(), mask, behav, cur,
                                                    strict=True)]}
            if s.episode is not None:
                sample["episode"] = {k: getattr(s.episode, k)
                                     for k in ("turns", "tool_calls", "tool_errors", "env_s", "end_reason")}
                sample["turns"] = episode_turns(tok, ids, mask)
            rec["samples"].append(sample)
        out.append(rec)
    return out


def print_records(records: list[dict], model_path: str, as_json: bool, weights_are: str = "") -> None:
    """`weights_are`: what the weights at `model_path` are (the learner's export, the starting weights)."""
    if as_json:
        print(json.dumps({"current_weights": model_path, "current_weights_are": weights_are, "groups": records},
                         indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"current log-probs: weights at {model_path}" + (f" ({weights_are})" if weights_are else ""))
    for rec in records:
        if "error" in rec:
            console.print(f"[red]{rec['entry']}: undecodable: {rec['error']}")
            continue
        console.rule(f"{rec['group_id']} from {rec['generator']} (entry {rec['entry']})")
        console.print(f"prompt: {rec['prompt']!r}")
        for s in rec["samples"]:
            if "episode" in s:
                ep = s["episode"]
                console.print(f"episode: {ep['turns']} turns, {ep['tool_calls']} tool calls, {ep['tool_errors']} "
                              f"tool errors, ended by {ep['end_reason']}  reward={s['reward']:.3f}")
                for turn in s["turns"]:
                    console.print(f"  [{turn['role']}] {turn['text']!r}")
            else:
                console.print(f"completion: {s['text']!r}  reward={s['reward']:.3f}  finish={s['finish_reason']}")
            table = Table()
            for col in ("token", "version", "behaviour lp", "current lp", "diff"):
                table.add_column(col)
            for t in s["tokens"]:
                if not t.get("policy", True):
                    continue  # an observation's tokens: no behaviour log-prob, not trained
                cur = t["current_logprob"]
                diff = "-" if cur is None else f"{cur - t['behaviour_logprob']:+.3f}"
                table.add_row(repr(t["token"]), str(t["version"]), f"{t['behaviour_logprob']:.3f}",
                              "-" if cur is None else f"{cur:.3f}", diff)
            console.print(table)
