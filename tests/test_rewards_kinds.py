"""Every reward kind: rule-based (exact match, numeric answer, format), a user function by dotted path,
a Hugging Face sequence-classification reward model scored in batches; per-sample error handling."""

import logging
import math
import sys

import pytest

from asyncrl.config import ConfigError
from asyncrl.tasks.rewards import build_reward, score_group


def test_rule_based_rewards(make_cfg):
    exact = build_reward(make_cfg("reward.name=exact_match").reward)
    assert exact(" 42\n", "42") == 1.0 and exact("42.", "42") == 0.0
    numeric = build_reward(make_cfg("reward.name=gsm8k").reward)
    assert numeric("so the answer is #### 1,200", "1200") == 1.0 and numeric("#### 12", "1200") == 0.0
    fmt = build_reward(make_cfg("reward.name=format", r"reward.format_regex=<think>.*</think>\s*\d+").reward)
    assert fmt("<think>a\nb</think> 7", "") == 1.0 and fmt("7", "") == 0.0
    with pytest.raises(ValueError, match="format_regex"):
        build_reward(make_cfg("reward.name=format", "reward.format_regex=(unclosed").reward)


def test_user_function_by_dotted_path(make_cfg, tmp_path, monkeypatch, caplog):
    (tmp_path / "my_rewards.py").write_text(
        "def score(completion, answer, **row):\n"
        "    if completion == 'boom':\n"
        "        raise ZeroDivisionError('user bug')\n"
        "    return len(completion) + (10 if row['prompt'].startswith('Q') else 0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = build_reward(make_cfg("reward.function=my_rewards:score").reward)
    row = {"prompt": "Q: x", "prompt_id": "p1", "group_id": "p1@e0"}
    with caplog.at_level(logging.WARNING, logger="asyncrl.tasks.rewards"):
        rewards, errors = score_group(fn, ["ab", "boom", "abc"], "ans", row)
    assert rewards == [12.0, 0.0, 13.0] and errors == 1
    assert "group=p1@e0 sample=1" in caplog.text and "user bug" in caplog.text
    with pytest.raises(ValueError, match="cannot import"):
        build_reward(make_cfg("reward.function=no_such_module_xyz:score").reward)
    with pytest.raises(ValueError, match="has no function"):
        build_reward(make_cfg("reward.function=my_rewards:nope").reward)
    with pytest.raises(ConfigError, match="not both"):
        make_cfg("reward.function=my_rewards:score", "reward.model=/x")
    sys.modules.pop("my_rewards", None)


def _tiny_reward_model(path, tiny_model):
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tiny_model)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_reward_model_scores_groups_in_batches(make_cfg, tmp_path, tiny_model):
    path = _tiny_reward_model(tmp_path / "rm", tiny_model)
    rm = build_reward(make_cfg(f"reward.model={path}", "reward.model_batch_size=3").reward)
    texts = ["abc", "a", "hgfedcba", "", "bb", "dcba", "e"]
    row = {"prompt": "abc=", "prompt_id": "p", "group_id": "p@e0"}
    batched, errors = score_group(rm, texts, "abc", row)
    assert errors == 0 and rm.num_batches == math.ceil(len(texts) / 3)
    # Padding inside a batch must not change a score: each alone gives the same number.
    alone = [rm(t, "abc", **row) for t in texts]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len(set(round(s, 5) for s in batched)) > 1, "a constant score would prove nothing"
    with pytest.raises(ValueError, match="num_labels=1"):
        from transformers import AutoConfig, Qwen2ForSequenceClassification

        c = AutoConfig.from_pretrained(path)
        c.num_labels = 2
        Qwen2ForSequenceClassification(c).save_pretrained(tmp_path / "rm2")
        build_reward(make_cfg(f"reward.model={tmp_path / 'rm2'}").reward)
