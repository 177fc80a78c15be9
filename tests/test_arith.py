"""The arithmetic task: problems, prompts, the held-out set, the exact-integer reward, the config."""

from __future__ import annotations

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.tasks.arith import (
    arith_problems,
    arith_reward,
    eval_set,
    extract_integer,
    operand_range,
    train_set,
)
from asyncrl.tasks.evaluation import load_eval_set
from asyncrl.tasks.rewards import build_reward, is_correct


def _cfg(*overrides):
    return load_config(None, ["data.task=arith", "reward.name=arith", *overrides])


def test_problems_follow_ops_and_digits():
    problems = arith_problems(500, seed=3, ops="+-", min_digits=2, max_digits=2)
    assert len(problems) == 500
    assert {op for _, op, _ in problems} == {"+", "-"}
    assert all(10 <= a <= 99 and 10 <= b <= 99 for a, _, b in problems)
    assert arith_problems(500, seed=3, ops="+-", min_digits=2, max_digits=2) == problems  # deterministic
    one = arith_problems(300, seed=0, ops="*", min_digits=1, max_digits=3)
    digits = {len(str(a)) for a, _, _ in one} | {len(str(b)) for _, _, b in one}
    assert digits == {1, 2, 3} and {op for _, op, _ in one} == {"*"}
    assert operand_range(1) == (0, 9) and operand_range(3) == (100, 999)
    assert any(a < b for a, op, b in problems if op == "-")
    nonneg = arith_problems(500, seed=3, ops="+-", min_digits=2, max_digits=2, nonnegative=True)
    assert all(a >= b for a, op, b in nonneg if op == "-") and len({op for _, op, _ in nonneg}) == 2


def test_records_ask_for_the_number_and_hold_the_exact_answer():
    cfg = _cfg("data.num_prompts=64", "data.arith_ops=+-*")
    rows = train_set(cfg)
    assert len(rows) == 64 and len({r.prompt_id for r in rows}) == 64
    for r in rows:
        assert r.prompt.startswith("What is ") and r.prompt.endswith("? Answer with the number only.")
        a, op, b = r.prompt[len("What is "):].split("?")[0].split()
        assert int(r.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    custom = train_set(_cfg("data.num_prompts=2", "data.arith_prompt={a}{op}{b}="))
    assert custom[0].prompt.endswith("=") and " " not in custom[0].prompt


def test_held_out_set_has_another_seed_and_none_of_the_training_problems():
    cfg = _cfg("data.num_prompts=2000", "eval.num_prompts=200")
    train, held_out = train_set(cfg), eval_set(cfg)
    assert len(held_out) == 200
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}
    assert [r.prompt for r in load_eval_set(cfg)] == [r.prompt for r in held_out]  # what eval rounds use
    assert held_out[0].prompt_id.startswith(f"arith-{cfg.run.seed + 104_729}-")
    # One-digit addition has 100 problems, about ten of them on the held-out side: the held-out set
    # is complete, never short or stuck, and still apart from 1024 training prompts.
    small = _cfg("data.arith_ops=+", "data.arith_min_digits=1", "data.arith_max_digits=1", "eval.num_prompts=50")
    assert len(eval_set(small)) == 50
    assert not {r.prompt for r in train_set(small)} & {r.prompt for r in eval_set(small)}


def test_held_out_set_follows_the_training_mix():
    """Operands of one or two digits: a quarter of the problems have two one-digit operands, in the
    training prompts and in the held-out set alike (a held-out set made of what training missed
    would have almost none of them: that small corner of the problem space is trained on first)."""
    cfg = _cfg("data.num_prompts=20000", "eval.num_prompts=1000", "data.arith_min_digits=1",
               "data.arith_max_digits=2")

    def small_share(rows):
        operands = [r.prompt[len("What is "):].split("?")[0].split() for r in rows]
        return sum(len(a) == 1 and len(b) == 1 for a, _, b in operands) / len(rows)

    train, held_out = train_set(cfg), eval_set(cfg)
    assert 0.22 < small_share(train) < 0.28 and 0.2 < small_share(held_out) < 0.3
    assert not {r.prompt for r in train} & {r.prompt for r in held_out}


@pytest.mark.parametrize("completion,value", [
    ("42", 42), (" 42\n", 42), ("The answer is 42.", 42), ("47 + 38 = 85", 85), ("-7", -7),
    ("The result is -12", -12), ("10-3", 3), ("x = -3", -3), ("1,234", 1234), ("12.0", 12), ("12.50", None),
    ("3.5", None), ("\\boxed{17}", 17), ("so \\boxed{-4} and then 99", -4), ("\\boxed{1,000}", 1000),
    ("\\boxed{x}", None), ("", None), ("no number here", None), ("x2", None), ("85<|im_end|>", 85),
    ("Answer: 85\n\nExplanation: 47 + 38", 38),  # the last number, as documented: explaining costs the reward
])
def test_extract_integer(completion, value):
    assert extract_integer(completion) == value


def test_reward_is_exact_integer_match():
    assert arith_reward("85", "85") == 1.0
    assert arith_reward("The answer is 85.", "85") == 1.0
    assert arith_reward("84", "85") == 0.0
    assert arith_reward("85.5", "85") == 0.0
    assert arith_reward("-9", "-9") == 1.0 and arith_reward("9", "-9") == 0.0
    assert arith_reward("", "0") == 0.0 and arith_reward("0", "0") == 1.0
    fn = build_reward(_cfg().reward)
    assert fn is arith_reward and is_correct(fn, "\\boxed{85}", "85") and not is_correct(fn, "8 5", "85")


def test_config_checks():
    with pytest.raises(ConfigError, match="data.arith_ops"):
        _cfg("data.arith_ops=+/")
    with pytest.raises(ConfigError, match="arith_min_digits"):
        _cfg("data.arith_min_digits=3", "data.arith_max_digits=2")
    with pytest.raises(ConfigError, match="arith_prompt"):
        _cfg("data.arith_prompt=What is {x}?")
    with pytest.raises(ConfigError, match="reward.name=arith"):
        load_config(None, ["data.task=arith"])
    assert _cfg().data.path == ""  # no dataset file needed
