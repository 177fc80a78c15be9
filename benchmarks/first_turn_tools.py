"""How often a model's first turn calls the calculator, by the number of demonstration turns before it.

The calculator task's first turn (`data.task=calc`: its system prompt, 0, 1 or 2 of its worked
exchanges, then a training problem), sampled with Hugging Face `generate` at temperature 1.0; a turn
counts when it holds a well-formed calculator call of exactly the problem's product
(`asyncrl/envs/tools.py` reads it). Prints a table and writes a JSON.

    python benchmarks/first_turn_tools.py --model models/smollm2-135m-instruct \\
        --json benchmarks/results/first_turn_tools_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from asyncrl.config import load_config  # noqa: E402
from asyncrl.envs import calc  # noqa: E402
from asyncrl.envs.base import examples_of, system_prompt_of  # noqa: E402
from asyncrl.envs.tools import ToolCall, parse_tool_call  # noqa: E402


def first_turns(model, tok, rows, cfg, max_new_tokens: int, seed: int) -> list[str]:
    """The first turns of `rows` as the generator opens their episodes under `cfg` (system prompt and
    worked exchanges, generators/episodes.py `episode_start`), batched in one `generate`."""
    head = [{"role": "system", "content": system_prompt_of(calc.CalculatorEnv, cfg)},
            *examples_of(calc.CalculatorEnv, cfg)]
    messages = [[*head, {"role": "user", "content": r.prompt}] for r in rows]
    tok.padding_side = "left"
    enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", padding=True,
                                  return_dict=True)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0,
                             pad_token_id=tok.pad_token_id or tok.eos_token_id)
    return [tok.decode(o[enc["input_ids"].shape[1]:], skip_special_tokens=True) for o in out]


def calls_the_product(text: str, prompt: str) -> bool:
    call = parse_tool_call(text, calc.TOOLS)
    want = prompt[len("What is "):-1].replace(" ", "")
    return isinstance(call, ToolCall) and call.argument.replace(" ", "") == want


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--problems", type=int, default=24)
    ap.add_argument("--shots", default="0,1,2", help="worked exchanges before the problem")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rows = calc.train_rows(load_config(None, ["data.task=calc", f"data.num_prompts={args.problems}"]))
    results = []
    print(f"{'shots':>5} {'calls':>9} {'rate':>6} {'seconds':>8}")
    for shots in (int(s) for s in args.shots.split(",")):
        t0 = time.perf_counter()
        cfg = load_config(None, ["data.task=calc", f"env.examples={shots}"])
        texts = first_turns(model, tok, rows, cfg, args.max_new_tokens, args.seed)
        hits = sum(calls_the_product(t, r.prompt) for t, r in zip(texts, rows, strict=True))
        seconds = time.perf_counter() - t0
        results.append({"shots": shots, "calls": hits, "problems": len(rows), "rate": hits / len(rows),
                        "seconds": round(seconds, 1), "first_turns": texts[:6]})
        print(f"{shots:>5} {hits:>4} / {len(rows):<3} {hits / len(rows):>6.2f} {seconds:>8.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "benchmark": "first_turn_tools", "model": args.model, "temperature": 1.0, "seed": args.seed,
            "max_new_tokens": args.max_new_tokens, "system_prompt": calc.SYSTEM_PROMPT, "results": results},
            indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
