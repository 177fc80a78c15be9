"""Greedy accuracy of a model on a config's held-out evaluation set, outside a run.

What an evaluation round's `eval/pass@1` would say for the model at `model.path` before any training:
the same held-out prompts (`asyncrl.tasks.evaluation.load_eval_set`), the same prompt encoding (chat
template per `data.chat_template`), the same reward and correctness test, greedy, `generator.max_tokens`
new tokens, through vLLM (its CPU build here, CUDA where installed).

    python benchmarks/base_accuracy.py configs/smollm2_arith_cpu.yaml eval.num_prompts=200 generator.max_tokens=32
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--show", type=int, default=5, help="print this many completions")
    parser.add_argument("--out", default="", help="write the numbers to this JSON file")
    args = parser.parse_args()

    from asyncrl.config import load_config

    cfg = load_config(args.config, args.overrides)
    from generators.vllm_engine import cpu_env_defaults

    cpu_env_defaults(cfg)
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from asyncrl.tasks.data import encode_prompt
    from asyncrl.tasks.evaluation import load_eval_set
    from asyncrl.tasks.rewards import build_reward, is_correct

    rows = load_eval_set(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
    prompts = [{"prompt_token_ids": encode_prompt(tokenizer, r.prompt, cfg.data.chat_template)} for r in rows]
    g = cfg.generator
    llm = LLM(model=cfg.model_path, dtype=g.dtype, max_model_len=g.max_model_len, enforce_eager=g.enforce_eager,
              gpu_memory_utilization=g.gpu_memory_utilization, seed=cfg.run.seed)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=g.max_tokens))
    seconds = time.perf_counter() - t0
    reward_fn = build_reward(cfg.reward)
    texts = [o.outputs[0].text for o in outs]
    correct = [is_correct(reward_fn, t, r.answer) for t, r in zip(texts, rows, strict=True)]
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    truncated = sum(o.outputs[0].finish_reason == "length" for o in outs)
    for r, t, ok in list(zip(rows, texts, correct, strict=True))[:args.show]:
        print(f"{'OK ' if ok else 'BAD'} {r.prompt!r} -> {t!r} (answer {r.answer})")
    result = {"model": cfg.model_path, "task": cfg.data.task, "num_prompts": len(rows),
              "max_tokens": g.max_tokens, "greedy_accuracy": sum(correct) / len(rows),
              "truncated": truncated / len(rows), "mean_tokens": num_tokens / len(rows),
              "seconds": round(seconds, 2)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
