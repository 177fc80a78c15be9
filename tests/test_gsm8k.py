"""GSM8K: data preparation, the math reward, the eval protocol pieces, and a tiny-model run on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from asyncrl.config import REPO_CONFIGS, ConfigError, load_config
from asyncrl.protocol import schema
from asyncrl.tasks.data import encode_prompt, gsm8k_final_answer, load_prompt_file, prepare_gsm8k
from asyncrl.tasks.evaluation import Round, load_eval_set, make_tasks, summarize
from asyncrl.tasks.math_reward import (
    MathReward,
    answers_match,
    extract_answer,
    normalize_answer,
    parse_number,
)
from asyncrl.tasks.rewards import build_reward, is_correct

GSM8K = Path(__file__).resolve().parent / "data" / "gsm8k"  # a few rows of each split (README.md there)
NUM_TRAIN, NUM_TEST = 16, 30


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    counts = prepare_gsm8k(str(GSM8K), out)
    return out, counts


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- data preparation --------------------------------------------------------------------------


def test_converter_row_counts_and_fields(prepared):
    import pyarrow.parquet as pq

    out, counts = prepared
    assert counts == {"train": NUM_TRAIN, "test": NUM_TEST}
    for split, num in counts.items():
        table = pq.read_table(out / f"{split}.parquet")
        assert table.num_rows == num
        assert {"id", "prompt", "answer", "question", "solution", "messages"} <= set(table.column_names)
    rows = pq.read_table(out / "test.parquet").to_pylist()
    src = _jsonl(GSM8K / "test.jsonl")
    first = rows[0]
    assert first["id"] == "gsm8k-test-0" and first["answer"] == "18"
    assert first["question"] == src[0]["question"].strip() and first["solution"] == src[0]["answer"]
    assert first["prompt"].startswith(first["question"]) and '"####"' in first["prompt"]
    assert first["messages"] == [{"role": "user", "content": first["prompt"]}]
    # Final answers are plain numbers: thousands separators gone, none empty.
    assert src[27]["answer"].endswith("#### 2,125") and rows[27]["answer"] == "2125"
    assert all(r["answer"] and "," not in r["answer"] and parse_number(r["answer"]) is not None for r in rows)
    assert len({r["id"] for r in rows}) == len(rows)


def test_cli_data_command_writes_parquet(tmp_path):
    r = subprocess.run([sys.executable, "-m", "asyncrl", "data", "gsm8k", "--src", str(GSM8K), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"train.parquet: {NUM_TRAIN} rows" in r.stdout and f"test.parquet: {NUM_TEST} rows" in r.stdout
    r = subprocess.run([sys.executable, "-m", "asyncrl", "data", "gsm8k", "--src", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o2")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "train.jsonl" in r.stderr


def test_prompt_loader_reads_jsonl_and_parquet_with_configured_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": f"what is {i}+1?", "a": str(i + 1), "key": f"k{i}"} for i in range(5)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.jsonl", "d.parquet"):
        recs = load_prompt_file(tmp_path / name, prompt_key="q", answer_key="a", id_key="key")
        assert [(r.prompt_id, r.prompt, r.answer) for r in recs] == [(x["key"], x["q"], x["a"]) for x in rows]
    recs = load_prompt_file(tmp_path / "d.jsonl", prompt_key="q", answer_key="a", limit=2)
    assert [r.prompt_id for r in recs] == ["d-0", "d-1"]
    with pytest.raises(ValueError, match=r"no column\(s\) \['question'\]"):
        load_prompt_file(tmp_path / "d.jsonl", prompt_key="question", answer_key="a")
    with pytest.raises(ValueError, match="no prompts left"):
        load_prompt_file(tmp_path / "d.jsonl", prompt_key="q", answer_key="a", max_prompt_chars=3)


def test_config_requires_a_data_path_for_file_tasks():
    with pytest.raises(ConfigError, match="data.path must name a parquet/jsonl file"):
        load_config(None, ["data.task=gsm8k"])
    cfg = load_config(REPO_CONFIGS / "gsm8k_grpo_qwen2.5_0.5b.yaml")
    assert cfg.model.path == "Qwen/Qwen2.5-0.5B-Instruct" and cfg.reward.name == "gsm8k" and cfg.eval.every > 0


def test_chat_template_falls_back_to_plain_text_without_one(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    plain = tok("2+2=", add_special_tokens=False)["input_ids"]
    assert encode_prompt(tok, "2+2=", chat_template=True) == plain
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    templated = encode_prompt(tok, "2+2=", chat_template=True)
    assert templated == tok("<s>2+2=</s>>", add_special_tokens=False)["input_ids"] != plain
    assert encode_prompt(tok, "2+2=", chat_template=False) == plain


# ---- the reward --------------------------------------------------------------------------------


def test_reward_is_one_on_every_reference_solution_of_the_test_split():
    rows = _jsonl(GSM8K / "test.jsonl")
    reward = build_reward(load_config(None, ["reward.name=gsm8k"]).reward)
    scores = [reward(r["answer"], gsm8k_final_answer(r["answer"])) for r in rows]
    assert len(scores) == NUM_TEST and min(scores) == 1.0


def test_reward_on_other_questions_answers_is_one_only_when_they_agree():
    """Solution i scored against the final answer of question j != i: 1.0 exactly when the two
    questions share a final answer (rows 0 and 13 both end in 18, rows 18 and 22 in 7), never otherwise."""
    rows = _jsonl(GSM8K / "test.jsonl")
    gold = [gsm8k_final_answer(r["answer"]) for r in rows]
    reward = MathReward()
    pairs = [(i, j) for i in range(len(rows)) for j in range(len(rows)) if i != j]
    same = {(i, j): parse_number(gold[i]) == parse_number(gold[j]) for i, j in pairs}
    assert sum(same.values()) >= 4  # both orders of each shared answer: the 1.0 case is exercised
    assert all(reward(rows[i]["answer"], gold[j]) == float(same[i, j]) for i, j in pairs)


@pytest.mark.parametrize("text,mode,expected", [
    ("so 3 + 4 = 7\n#### 7", "auto", "7"),
    ("#### $1,234.50 dollars", "hash", "$1,234.50 dollars"),
    ("The answer is \\boxed{\\frac{3}{4}}.", "auto", "\\frac{3}{4}"),
    ("nested \\boxed{\\text{5 {cm}}} done", "boxed", "\\text{5 {cm}}"),
    ("I have 3 apples and 12 pears, total 15.", "last_number", "15"),
    ("Total: 1,000,000 grains.", "auto", "1,000,000"),
    ("The answer is 42. Check: 6 * 7 = 42, 10 more is 52", "auto", "42"),
    ("no numbers here", "auto", None),
    ("cut off \\boxed{12", "boxed", None),
    ("4 then -3.5", "last_number", "-3.5"),
    ("#### 5\n#### 6", "hash", "6"),
    ("#### 9", "boxed", None),
])
def test_extraction(text, mode, expected):
    assert extract_answer(text, mode) == expected


@pytest.mark.parametrize("raw,expected", [
    ("$1,234.50", "1234.5"), ("18 dollars", "18"), ("50%", "50"), ("50\\%", "50"), ("18.0", "18"),
    ("0.50", "0.5"), ("\\text{5 cm}", "5"), ("-3.", "-3"), ("1/3", "1/3"), ("\\frac{6}{8}", "0.75"),
    ("= 42", "42"), ("  7 ", "7"), ("\\$12", "12"), ("1,000,000", "1000000"), (".5", "0.5"),
    ("3 apples per box", "3"), ("x + 1", "x+1"),
])
def test_normalisation(raw, expected):
    assert normalize_answer(raw) == expected


def test_matching_and_score_shape():
    assert answers_match("18.00", "18") and answers_match("$18", "18") and answers_match("1/2", "0.5")
    assert not answers_match("18.5", "18") and not answers_match("", "18") and not answers_match("-18", "18")
    assert answers_match("\\frac{1}{2}", "0.5", use_math_verify=False)
    bonus = MathReward(extract="hash", format_bonus=0.1)
    assert bonus("work... #### 18", "18") == 1.0
    assert bonus("work... #### 17", "18") == pytest.approx(0.1)
    assert bonus("the answer is 18", "18") == 0.0  # strict: no '####', no answer found
    assert MathReward()("the answer is 18", "18") == 1.0
    assert is_correct(bonus, "#### 17", "18") is False and is_correct(bonus, "#### 18", "18") is True
    with pytest.raises(ValueError, match="reward.extract"):
        MathReward(extract="guess")


def test_math_verify_handles_symbolic_answers_when_installed():
    pytest.importorskip("math_verify")
    assert answers_match("\\sqrt{4}", "2")
    assert answers_match("2\\pi", "\\pi \\cdot 2")
    assert not answers_match("\\sqrt{5}", "2")
    assert not answers_match("\\sqrt{4}", "2", use_math_verify=False)


# ---- evaluation pieces -------------------------------------------------------------------------


def _result(prompt_id, greedy, samples, version=3):
    return schema.EvalResult(schema_version=schema.SCHEMA_VERSION, round_id=f"v{version}", version=version,
                             prompt_id=prompt_id, generator_id="g0", greedy_correct=greedy,
                             greedy_reward=float(greedy), sample_correct=schema.pack_i32(samples),
                             sample_rewards=schema.pack_f32([float(s) for s in samples]), min_version=version,
                             num_tokens=10, finished_at=0.0)


def test_eval_messages_round_trip_and_summary():
    task = make_tasks(load_eval_set(load_config(None, ["eval.every=1", "eval.num_prompts=3"])), 5, 2, 1.0)[0]
    assert schema.decode(schema.encode(task), schema.EvalTask) == task and task.round_id == "v5"
    res = _result("p0", True, [1, 0])
    assert schema.decode(schema.encode(res), schema.EvalResult) == res
    with pytest.raises(schema.FrameError):
        schema.decode(schema.encode(res), schema.EvalTask)
    rnd = Round(version=3, num_prompts=3, published_at=0.0)
    for r in (_result("p0", True, [1, 0]), _result("p1", False, [0, 0]), _result("p0", False, [0, 0]),
              _result("p2", False, [1, 1])):
        rnd.add(r)  # the duplicate p0 (a reclaimed task finished twice) is ignored
    assert rnd.complete
    s = summarize(list(rnd.results.values()), k=2)
    assert s["eval/pass@1"] == pytest.approx(1 / 3)
    assert s["eval/mean@k"] == pytest.approx(3 / 6)
    assert s["eval/pass@k"] == pytest.approx(2 / 3)
    assert "eval/tool_call_frac" not in s  # single completions have no turns
    played = [msgspec.structs.replace(r, greedy_turns=t, greedy_tool_calls=c)
              for r, (t, c) in zip(rnd.results.values(), [(2, 1), (1, 0), (3, 2)], strict=True)]
    assert schema.decode(schema.encode(played[2]), schema.EvalResult) == played[2]
    s = summarize(played, k=2)
    assert s["eval/turns_mean"] == 2.0 and s["eval/tool_calls_mean"] == 1.0
    assert s["eval/tool_call_frac"] == pytest.approx(2 / 3)


def test_eval_set_is_the_head_of_the_test_split(prepared):
    out, _ = prepared
    cfg = load_config(REPO_CONFIGS / "gsm8k_grpo_qwen2.5_0.5b.yaml",
                      [f"data.path={out / 'train.parquet'}", "eval.num_prompts=5"])
    rows = load_eval_set(cfg)
    assert [r.prompt_id for r in rows] == [f"gsm8k-test-{i}" for i in range(5)] and rows[0].answer == "18"


# ---- a tiny-model GSM8K run on CPU -------------------------------------------------------------


@pytest.mark.slow
def test_tiny_gsm8k_run_logs_eval_metrics(tmp_path, tiny_model, prepared):
    out, _ = prepared
    steps = 4
    r = subprocess.run([sys.executable, "-m", "asyncrl", "run", str(REPO_CONFIGS / "tiny_gsm8k.yaml"),
                        f"run.dir={tmp_path / 'runs'}", f"run.max_steps={steps}", f"model.path={tiny_model}",
                        f"data.path={out / 'train.parquet'}", "generator.kv_cache_gb=0.5"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "tiny_gsm8k"
    rows = _jsonl(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    evals = [row for row in rows if "eval/pass@1" in row]
    assert evals, "no eval metrics in metrics.jsonl"
    final = rows[-1]
    # The last step waits for its own round: the final model is always evaluated.
    assert final["eval/version"] == steps and final["eval/num_prompts"] == 4 and final["eval/k"] == 2
    for row in evals:
        assert 0.0 <= row["eval/pass@1"] <= 1.0 and 0.0 <= row["eval/mean@k"] <= 1.0
        assert row["eval/min_version"] >= row["eval/version"] and row["eval/tokens"] > 0
    rounds = _jsonl(run_dir / "eval.jsonl")
    assert [e["eval/version"] for e in rounds] == [0, 2, 4]  # the starting weights first
    assert "eval version=4 pass@1=" in r.stdout
    # Rewards are real GSM8K scores of the tiny model's text: in [0, 1].
    assert all(0.0 <= row["reward_mean"] <= 1.0 for row in rows)
