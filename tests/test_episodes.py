"""Multi-turn episodes: the wire frames of schema version 3, the learner counting only the policy's
tokens, tool-call parsing, the shipped environments and the Python sandbox."""

import asyncio
import os
import time

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, load_config
from asyncrl.envs import calc, guess
from asyncrl.envs.python_tool import PythonToolEnv
from asyncrl.envs.sandbox import SandboxLimits, run_python
from asyncrl.envs.tools import ToolCall, ToolCallError, parse_tool_call
from asyncrl.protocol import schema
from asyncrl.tasks.base import PromptRecord
from learners import packing
from learners.batch import build_step, micro_batch
from learners.step import batch_targets, policy_update
from tests.test_microbatch import tiny_lm

# One episode: turn (3 tokens), observation (2), turn (2).
MASK = [1, 1, 1, 0, 0, 1, 1]


def episode_sample(i: int, mask=MASK, obs_logprob=0.0, reward=None) -> schema.Sample:
    n = len(mask)
    lps = [-0.4 - 0.05 * j if m else obs_logprob for j, m in enumerate(mask)]
    return schema.Sample(completion_ids=schema.pack_i32([5 + (i + j) % 20 for j in range(n)]),
                         logprobs=schema.pack_f32(lps), versions=schema.pack_i32([0] * n),
                         reward=float(i % 2) if reward is None else reward, finish_reason="stop",
                         loss_mask=bytes(mask),
                         episode=schema.EpisodeInfo(turns=2, tool_calls=1, tool_errors=0, env_s=0.01,
                                                    end_reason="done"))


def episode_group(g: int = 0, n: int = 4, **kw) -> schema.TrajectoryGroup:
    return schema.TrajectoryGroup(schema_version=schema.EPISODE_SCHEMA_VERSION, group_id=f"p{g}@e0",
                                  prompt_id=f"p{g}", generator_id="t", prompt_ids=schema.pack_i32([13, 14, 15]),
                                  samples=[episode_sample(i + g, **kw) for i in range(n)],
                                  sampling=schema.SamplingInfo(1.0, 1.0, -1), created_at=time.time())


def test_an_episode_frame_round_trips_and_a_bad_one_is_refused_with_its_reason():
    group = episode_group()
    back = schema.decode(schema.encode(group), schema.TrajectoryGroup)
    assert back.samples[0].policy_mask().tolist() == MASK and back.samples[0].num_policy_tokens == 5
    assert back.samples[0].episode.end_reason == "done"

    def refused(mutate) -> str:
        g = episode_group()
        mutate(g)
        with pytest.raises(schema.FrameError) as e:
            schema.decode(schema.encode(g), schema.TrajectoryGroup)
        return e.value.reason

    assert refused(lambda g: setattr(g.samples[0], "loss_mask", bytes(MASK[:-1]))) == "bad_mask"
    assert refused(lambda g: setattr(g.samples[0], "loss_mask", bytes([0] * 7))) == "bad_mask"
    assert refused(lambda g: setattr(g.samples[0], "loss_mask", bytes([2] * 7))) == "bad_mask"
    # Episode fields in a version-2 frame: refused, saying which version they need.
    assert refused(lambda g: setattr(g, "schema_version", schema.SCHEMA_VERSION)) == "schema_version"
    assert refused(lambda g: setattr(g, "schema_version", 4)) == "schema_version"
    assert refused(lambda g: setattr(g.samples[1], "episode", schema.EpisodeInfo(turns=-1))) == "bad_episode"


def test_a_version_2_frame_still_decodes_with_every_token_the_policys():
    from tests.helpers import make_group

    back = schema.decode(schema.encode(make_group()), schema.TrajectoryGroup)
    assert back.schema_version == 2 and back.samples[0].policy_mask().tolist() == [1, 1, 1]
    assert build_step([back], "cpu").policy_mask_np is None


def _update(groups, cfg):
    model = tiny_lm()
    step = build_step(groups, "cpu")
    plan = packing.plan_step(step.group_sizes, step.lengths, step.policy_len, world=1, minibatches=1, epochs=1,
                             budget=10_000, packed=cfg.learner.packing, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    grads = {}
    orig = opt.step

    def capture():
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        orig()

    opt.step = capture
    targets = batch_targets(model, step, plan, cfg)
    return step, plan, targets, policy_update(model, opt, step, plan, cfg, targets), grads


@pytest.mark.parametrize("packed", [True, False])
def test_observation_tokens_are_context_but_never_weigh_in_the_update(packed):
    cfg = load_config(None, [f"learner.packing={str(packed).lower()}", "algorithm.aggregation=token_mean",
                             "algorithm.advantage=grpo"])
    groups = [episode_group(0), episode_group(1)]
    step, plan, targets, stats, grads = _update(groups, cfg)
    assert step.num_policy_tokens == 8 * 5 and plan.epochs[0][0].num_tokens == 8 * 5
    mb = micro_batch(step, [0], packed, 0)
    assert mb.mask_bT[0].tolist() == [float(m) for m in MASK] and mb.num_tokens == 5
    adv = step.grid(targets.adv_N)
    assert torch.all(adv[:, 3:5] == 0) and torch.any(adv[:, :3] != 0)
    # Other log-probs on the observation tokens (which the policy never sampled): the same update.
    _, _, _, stats2, grads2 = _update([episode_group(0, obs_logprob=-7.0), episode_group(1, obs_logprob=-7.0)], cfg)
    for k in ("loss", "entropy", "is_weight_mean", "ess"):
        assert stats2[k] == pytest.approx(stats[k], rel=1e-9, abs=1e-12), k
    for name, g in grads.items():
        torch.testing.assert_close(grads2[name], g)


def test_returns_cross_the_observation_between_turns():
    cfg = load_config(None, ["algorithm.advantage=reinforce_pp", "algorithm.kl_coef=0"])
    step, _, targets, _, _ = _update([episode_group(0)], cfg)
    adv = step.grid(targets.adv_N)
    # The reward sits on the last policy token; with gamma 1 the first turn's tokens get its return too.
    for s in range(step.num_seqs):
        first, last = adv[s, :3], adv[s, 5:]
        assert torch.allclose(first, last[:1].expand(3)) and bool(torch.all(adv[s, 3:5] == 0))


def test_tool_calls_are_parsed_in_both_formats_and_a_malformed_one_is_an_error():
    tools = {"calculator": "expression"}
    assert parse_tool_call("ok <calculator> 347*86 </calculator>", tools) == ToolCall("calculator", "347*86")
    assert parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>',
                           tools) == ToolCall("calculator", "2+2")
    assert parse_tool_call("the answer is \\boxed{4}", tools) is None
    for bad, says in [("<calculator>2+2", "not closed"), ("<calculator></calculator>", "empty"),
                      ('<tool_call>{"name": "calc"}</tool_call>', "no tool named"),
                      ("<tool_call>{oops}</tool_call>", "not valid JSON")]:
        err = parse_tool_call(bad, tools)
        assert isinstance(err, ToolCallError) and says in err.message, (bad, err)


def test_the_calculator_environment_answers_calls_errors_and_scores_the_answer():
    cfg = load_config(None, ["data.task=calc", "data.num_prompts=20"])
    rows = calc.train_rows(cfg)
    held = {r.prompt for r in calc.eval_rows(cfg)}
    assert len(rows) == 20 and not held & {r.prompt for r in rows}
    a, b = (int(x) for x in rows[0].prompt[len("What is "):-1].split(" * "))
    assert 100 <= a <= 999 and 10 <= b <= 99 and rows[0].answer == str(a * b)
    env = calc.CalculatorEnv(cfg, rows[0])

    async def play():
        r1 = await env.step(f"<calculator>{a}*{b}</calculator>")
        r2 = await env.step("<calculator>__import__('os')</calculator>")
        r3 = await env.step(f"\\boxed{{{a * b}}}")
        r4 = await env.step("\\boxed{1}")
        return r1, r2, r3, r4

    r1, r2, r3, r4 = asyncio.run(play())
    assert r1.observation == f"<result>{a * b}</result>" and r1.tool_calls == 1 and not r1.done
    assert r2.tool_errors == 1 and r2.observation.startswith("<error>")
    assert r3.done and r3.reward == 1.0 and r4.done and r4.reward == 0.0
    assert calc.evaluate("(7 + 3) * 12 / 4") == 30


def test_without_tools_the_calculator_is_not_offered_and_the_first_turn_is_the_answer():
    from asyncrl.envs.base import examples_of, system_prompt_of

    cfg = load_config(None, ["data.task=calc", "data.num_prompts=5", "env.tools=false"])
    row = calc.train_rows(cfg)[0]
    assert system_prompt_of(calc.CalculatorEnv, cfg) == calc.NO_TOOLS_PROMPT
    assert "calculator" not in calc.NO_TOOLS_PROMPT
    called = asyncio.run(calc.CalculatorEnv(cfg, row).step(f"<calculator>{row.prompt[8:-1]}</calculator>"))
    answered = asyncio.run(calc.CalculatorEnv(cfg, row).step(f"\\boxed{{{row.answer}}}"))
    assert called.done and called.reward == 0.0 and called.tool_calls == 0
    assert answered.done and answered.reward == 1.0
    with_tools = load_config(None, ["data.task=calc", "env.system_prompt=Be brief."])
    assert system_prompt_of(calc.CalculatorEnv, with_tools) == "Be brief."
    assert system_prompt_of(calc.CalculatorEnv, load_config(None, ["data.task=calc"])) == calc.SYSTEM_PROMPT
    # The demonstration turns follow: calls and results with the tool, direct answers without, or none.
    both = examples_of(calc.CalculatorEnv, with_tools)
    assert both == calc.EXAMPLES[0] + calc.EXAMPLES[1] and len(both) == 8
    assert "<calculator>12*34</calculator>" in [m["content"] for m in both]
    assert examples_of(calc.CalculatorEnv, cfg) == calc.NO_TOOLS_EXAMPLES[0] + calc.NO_TOOLS_EXAMPLES[1]
    assert not any("calculator" in m["content"] for m in examples_of(calc.CalculatorEnv, cfg))
    one = load_config(None, ["data.task=calc", "env.examples=1"])
    assert examples_of(calc.CalculatorEnv, one) == calc.EXAMPLES[0]
    assert examples_of(calc.CalculatorEnv, load_config(None, ["data.task=calc", "env.examples=0"])) == []
    assert all(calc.evaluate(m["content"][12:-13]) == int(n["content"][8:-9])
               for m, n in zip(both[1::4], both[2::4], strict=True))  # the examples are right


def test_the_guessing_game_says_higher_or_lower_and_pays_the_hit():
    cfg = load_config(None, ["data.task=guess", "env.guess_max=16"])
    env = guess.GuessEnv(cfg, PromptRecord("g", "guess", "11"))

    async def play():
        return [await env.step(t) for t in ("5", "I think 14", "hmm", "11")]

    low, high, bad, hit = asyncio.run(play())
    assert low.observation == "Higher." and high.observation == "Lower." and bad.tool_errors == 1
    assert hit.done and hit.reward == 1.0


def test_the_sandbox_runs_a_program_and_holds_it_to_its_limits():
    limits = SandboxLimits(cpu_s=1, memory_mb=256, output_bytes=256, timeout_s=2.0)

    async def runs():
        return await asyncio.gather(
            run_python("print(sum(range(10)))", limits),
            run_python("import os; print(sorted(os.environ))", limits),
            run_python("import socket; socket.socket()", limits),
            run_python("import time; time.sleep(30)", limits),
            run_python("print('x' * 100000)", limits),
            run_python("open('/etc/passwd').read()", limits),
            run_python("import subprocess; subprocess.run(['true'])", limits),
            run_python("while True: pass", limits))

    t0 = time.monotonic()
    ok, env, net, slow, loud, secret, spawn, spin = asyncio.run(runs())
    assert time.monotonic() - t0 < 10
    assert ok.ok and ok.stdout == "45\n"
    assert env.stdout.strip() == "['HOME', 'LANG', 'PATH', 'PYTHONDONTWRITEBYTECODE']"
    assert not net.ok and "socket" in net.stderr
    assert slow.timed_out and loud.output_cut and len(loud.stdout) == 256
    assert secret.exit_code == 1 and "may not open" in secret.stderr
    assert not spawn.ok and "not allowed" in spawn.stderr
    assert spin.exit_code is not None and spin.exit_code < 0  # SIGXCPU at the CPU limit


def test_the_sandbox_refuses_the_ways_around_its_audit_hook(tmp_path):
    """Native spawn helpers, renames and links out of its folder, truncation and mode changes outside
    it, changing directory, forking; run as root, the program runs as `nobody`."""
    victim = tmp_path / "victim.txt"
    victim.write_text("intact")
    limits = SandboxLimits(cpu_s=1, memory_mb=256, output_bytes=512, timeout_s=3.0)
    attacks = {
        "posixsubprocess": "import _posixsubprocess",
        "rename_out": f"open('x', 'w').write('1'); import os; os.rename('x', {str(tmp_path / 'moved')!r})",
        "link_out": f"open('x', 'w').write('1'); import os; os.link('x', {str(tmp_path / 'linked')!r})",
        "truncate": f"import os; os.truncate({str(victim)!r}, 0)",
        "chmod": f"import os; os.chmod({str(victim)!r}, 0o777)",
        "chdir": "import os; os.chdir('/'); open('etc/passwd').read()",
        "fork": "import os; os.fork()",
        "uid": "import os; print(os.getuid(), os.geteuid())",
    }

    async def runs():
        return await asyncio.gather(*(run_python(code, limits) for code in attacks.values()))

    results = dict(zip(attacks, asyncio.run(runs()), strict=True))
    for name in ("posixsubprocess", "rename_out", "link_out", "truncate", "chmod", "chdir", "fork"):
        r = results[name]
        assert not r.ok and ("not allowed" in r.stderr or "may not" in r.stderr), (name, r.stderr[-300:])
    assert victim.read_text() == "intact" and oct(victim.stat().st_mode & 0o777) != oct(0o777)
    assert not (tmp_path / "moved").exists() and not (tmp_path / "linked").exists()
    assert results["uid"].ok, results["uid"].stderr
    if os.getuid() == 0:
        assert results["uid"].stdout.split() == ["65534", "65534"], "root runs the program as nobody"


def test_the_python_tool_environment_turns_a_failed_run_into_an_error_observation():
    cfg = load_config(None, ["data.task=gsm8k_python", "data.path=x.parquet"])
    env = PythonToolEnv(cfg, PromptRecord("q", "question", "72"))

    async def play():
        return [await env.step(t) for t in ("<python>print(8 * 9)</python>", "<python>1/0</python>",
                                            "so \\boxed{72}")]

    out, err, answer = asyncio.run(play())
    assert out.observation == "<output>72</output>" and out.tool_calls == 1 and out.tool_errors == 0
    assert err.observation == "<error>ZeroDivisionError: division by zero</error>" and err.tool_errors == 1
    assert answer.done and answer.reward == 1.0
    assert np.isfinite(out.info["sandbox_s"])


@pytest.mark.parametrize("override, says", [
    ("algorithm.advantage=remax", "takes a greedy completion of each prompt as its baseline"),
    ("generator.backend=hf", "multi-turn episodes run on generator.backend=vllm"),
    ("env.max_tokens=4096", "must be below generator.max_model_len"),
])
def test_settings_episodes_cannot_run_with_are_refused_in_one_line(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, ["data.task=guess", override])


def test_periodic_evaluation_is_allowed_with_an_environment_task():
    assert load_config(None, ["data.task=calc", "eval.every=5"]).eval.every == 5
