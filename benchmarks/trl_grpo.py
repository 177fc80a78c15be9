"""TRL's synchronous GRPOTrainer on an asyncrl task: the baseline, with the same problems, reward and settings.

`run` makes the model folder as smollm2_curve.py does, launches `train` in a fresh process, stops it
once `--budget-s` seconds of wall time have passed since the launch, and leaves `metrics.jsonl`,
`eval.jsonl` and `launch.json` in the layout `smollm2_curve.py report` reads, so both systems' curves go
into one results JSON and one plot:

    python benchmarks/smollm2_curve.py run --mode async --budget-s 400 --out /tmp/curve
    python benchmarks/trl_grpo.py run --budget-s 400 --out /tmp/curve
    python benchmarks/smollm2_curve.py report /tmp/curve/smollm2_arith_async /tmp/curve/smollm2_arith_trl \\
        --labels asyncrl,trl --json benchmarks/results/smollm2_arith_vs_trl.json --png docs/img/vs_trl.png

Everything TRL is told comes from the asyncrl config (`--config`, then overrides as `asyncrl run` takes
them), so the two runs cannot drift apart:
- the task's training prompts and held-out prompts, the config's reward (`reward.*`);
- generator.n -> num_generations; learner.batch_groups x n sequences a step (learner.minibatches
  optimizer steps of it: steps_per_generation); generator.max_tokens, temperature, top_p, top_k;
- learner.lr (constant, or warm-up/cosine as learner.lr_schedule says), weight_decay, max_grad_norm,
  AdamW (torch's defaults, as the learner); fp32 master weights with bf16 autocast where
  learner.mixed_precision.param_dtype is bfloat16 (CUDA);
- algorithm.clip_low/clip_high -> epsilon/epsilon_high; algorithm.kl_coef -> beta;
  aggregation token_mean -> loss_type dapo (token mean over the batch), seq_mean_token_mean -> grpo;
  advantage grpo -> scale_rewards group, dr_grpo -> none;
- on CUDA, generation by vLLM in the trainer's process (vllm_mode colocate, gpu_memory_utilization and
  max_model_len from generator.*), the weights loaded into it before every step; `--vllm off` (the
  default without CUDA) generates with transformers instead.

Held-out accuracy: before the first step and every eval.every steps, the eval.num_prompts held-out
prompts, encoded as asyncrl encodes them (chat template included), one greedy completion each of up to
generator.max_tokens tokens, correct as asyncrl's evaluation judges it. TRL stops to evaluate, while
asyncrl evaluates on its generator beside training; so the clock of every row written here is the wall
time since the launch less the time spent evaluating before it (loading the weights into vLLM is left
on the clock: the next step would do it anyway). `launch.json` records the evaluation time taken out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path


def cmd_run(args) -> int:
    from smollm2_curve import make_model, run_for  # a sibling script: benchmarks/ is the script's folder

    model = Path(args.model) if args.skip_convert else make_model(args)
    name = args.name or f"{Path(args.config).stem}_trl"
    out = Path(args.out) / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, __file__, "train", "--config", args.config, "--out", str(out), f"--vllm={args.vllm}",
           f"--micro-batch-seqs={args.micro_batch_seqs}", f"model.path={model}", *args.overrides]
    rc, t_launch, wall_s, stopped = run_for(cmd, args.budget_s)
    trained = json.loads((out / "train.json").read_text()) if (out / "train.json").exists() else {}
    meta = {"mode": "trl", "config": args.config, "overrides": args.overrides, "budget_s": args.budget_s,
            "t_launch": t_launch, "wall_s": wall_s, "rc": rc, **trained}
    (out / "launch.json").write_text(json.dumps(meta, indent=1))
    print(f"{name}: rc={rc} wall_s={wall_s:.0f} -> {out}", flush=True)
    steps = out / "metrics.jsonl"
    return 0 if rc == 0 or (stopped and steps.exists() and steps.stat().st_size > 0) else 1


def trl_settings(cfg, cuda: bool, use_vllm: bool, micro_batch_seqs: int = 0) -> dict:
    """GRPOConfig's arguments for an asyncrl config; a setting TRL has no counterpart for is an error.

    `micro_batch_seqs` sequences go through one forward/backward (0: a whole mini-batch at once); the
    gradients of a mini-batch accumulate over its micro-batches, so one optimizer step still sees
    learner.batch_groups x n / learner.minibatches sequences, as asyncrl's learner does."""
    g, lc, alg = cfg.generator, cfg.learner, cfg.algorithm
    losses = {"token_mean": "dapo", "seq_mean_token_mean": "grpo"}
    scales = {"grpo": "group", "dr_grpo": "none"}
    errors = []
    if alg.aggregation not in losses:
        errors.append(f"algorithm.aggregation={alg.aggregation} has no TRL loss_type (token_mean, seq_mean_token_mean)")
    if alg.advantage not in scales:
        errors.append(f"algorithm.advantage={alg.advantage} has no TRL counterpart (grpo, dr_grpo)")
    if lc.lora.enabled:
        errors.append("learner.lora.enabled=true: this baseline trains the full model")
    sequences = lc.batch_groups * g.n
    per_step = sequences // lc.minibatches
    micro = micro_batch_seqs or per_step
    if per_step % micro:
        errors.append(f"--micro-batch-seqs {micro} does not divide the {per_step} sequences of an optimizer step")
    if errors:
        raise SystemExit("; ".join(errors))
    accumulate = per_step // micro
    schedule = {"constant": "constant_with_warmup" if lc.warmup_steps else "constant", "cosine": "cosine"}
    bf16 = cuda and str(lc.mixed_precision.param_dtype) == "bfloat16"
    settings = {
        "seed": cfg.run.seed, "max_steps": cfg.run.max_steps,
        "num_generations": g.n, "per_device_train_batch_size": micro,
        "steps_per_generation": accumulate * lc.minibatches, "gradient_accumulation_steps": accumulate,
        "gradient_checkpointing": lc.activation_checkpointing is True,  # auto: the learner decides by memory; TRL runs without
        "max_completion_length": g.max_tokens, "temperature": g.temperature, "top_p": g.top_p,
        "top_k": g.top_k if g.top_k > 0 else 0,
        "learning_rate": lc.lr, "lr_scheduler_type": schedule[lc.lr_schedule], "warmup_steps": lc.warmup_steps,
        "weight_decay": lc.weight_decay, "max_grad_norm": lc.max_grad_norm,
        "optim": "adamw_torch_fused" if cuda else "adamw_torch",
        "bf16": bf16, "model_init_kwargs": {"dtype": "float32"},
        "beta": alg.kl_coef, "epsilon": alg.clip_low, "epsilon_high": alg.clip_high,
        "loss_type": losses[alg.aggregation], "scale_rewards": scales[alg.advantage],
        "use_vllm": use_vllm, "logging_steps": 1, "report_to": "none", "save_strategy": "no",
        "log_completions": False, "use_cpu": not cuda,
    }
    if use_vllm:
        settings.update(vllm_mode="colocate", vllm_gpu_memory_utilization=g.gpu_memory_utilization,
                        vllm_max_model_length=g.max_model_len)
    return settings


class Rows:
    """metrics.jsonl and eval.jsonl rows on the training clock: wall time less the evaluations'."""

    def __init__(self, out: Path, t_launch: float):
        self.out, self.t_launch, self.eval_s = out, t_launch, 0.0
        self.metrics = open(out / "metrics.jsonl", "a", buffering=1)
        self.evals = open(out / "eval.jsonl", "a", buffering=1)

    def clock(self) -> float:
        return time.time() - self.eval_s

    def metric(self, row: dict) -> None:
        self.metrics.write(json.dumps(row) + "\n")

    def evaluation(self, row: dict) -> None:
        self.evals.write(json.dumps(row) + "\n")


def make_callback(rows: Rows, evaluate, every: int):
    from transformers import TrainerCallback

    class HeldOut(TrainerCallback):
        """Held-out accuracy before the first step and every `every` steps; a metrics row a step."""

        def __init__(self):
            self.t_step = self.t_prev = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.t_prev = rows.clock()
            evaluate(0, self.t_prev)

        def on_step_end(self, args, state, control, **kwargs):
            self.t_step = rows.clock()
            if state.global_step % every == 0 or state.global_step == args.max_steps:
                evaluate(state.global_step, self.t_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs or self.t_step is None:
                return
            row = {"step": state.global_step, "time": self.t_step, "step_s": self.t_step - self.t_prev,
                   "reward_mean": logs.get("reward"), "loss": logs.get("loss"), "grad_norm": logs.get("grad_norm"),
                   "tokens": logs.get("num_tokens"),
                   "completion_len_mean": logs.get("completions/mean_length"),
                   "entropy": logs.get("entropy"), "clip_ratio": logs.get("clip_ratio/region_mean")}
            rows.metric({k: v for k, v in row.items() if v is not None})
            self.t_prev = self.t_step

    return HeldOut()


def make_evaluator(trainer, tokenizer, held_out, prompt_ids, reward_fn, max_tokens: int, rows: Rows, vllm: bool):
    """evaluate(step, t): greedy completions of the held-out prompts by the trainer's current weights."""
    import torch

    from asyncrl.tasks.rewards import is_correct

    def generate() -> list[list[int]]:
        if vllm:
            from vllm import SamplingParams

            if trainer._last_loaded_step != trainer.state.global_step:  # the next step would load them anyway
                trainer.vllm_generation.sync_weights()
                trainer._last_loaded_step = trainer.state.global_step
            outs = trainer.vllm_generation.llm.generate(
                [{"prompt_token_ids": ids} for ids in prompt_ids],
                SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
            return [list(o.outputs[0].token_ids) for o in outs]
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        done = []
        try:
            for i in range(0, len(prompt_ids), 64):
                chunk = prompt_ids[i:i + 64]
                width = max(len(ids) for ids in chunk)
                ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
                attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
                with torch.no_grad():
                    out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                                         max_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
                for row in out[:, width:].tolist():
                    end = next((j + 1 for j, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
                    done.append(row[:end])
        finally:
            model.train(was_training)
        return done

    def evaluate(step: int, t: float) -> None:
        start = time.time()
        completions = generate()
        correct = [is_correct(reward_fn, tokenizer.decode(c, skip_special_tokens=True), r.answer)
                   for c, r in zip(completions, held_out, strict=True)]
        took = time.time() - start
        rows.eval_s += took
        acc = sum(correct) / len(correct)
        rows.evaluation({"eval/pass@1": acc, "eval/version": step, "eval/published_at": t, "eval/n": len(correct),
                         "eval/s": round(took, 3)})
        print(f"eval step {step}: pass@1 {acc:.3f} ({len(correct)} prompts, {took:.1f} s)", flush=True)

    return evaluate


def train_dataset(rows: list[dict]):
    """The training rows as a `datasets.Dataset` whose fingerprint is the SHA-256 of the rows' JSON.

    Left to itself, `datasets` fingerprints a new dataset by dill-pickling its Arrow table, which fails
    where dill cannot pickle a pyarrow type ("Can't pickle <class 'MonthDayNano'>", seen with datasets
    5.2 and pyarrow 26 on Python 3.12); the rows are plain JSON, so their hash names them as well."""
    import hashlib

    from datasets import Dataset
    from datasets.table import InMemoryTable

    fingerprint = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()[:16]
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=fingerprint)


def cmd_train(args) -> int:
    from smollm2_curve import T_LAUNCH_ENV

    t_launch = float(os.environ.get(T_LAUNCH_ENV) or time.time())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config import load_config
    from asyncrl.tasks.data import encode_prompt
    from asyncrl.tasks.evaluation import load_eval_set
    from asyncrl.tasks.registry import get_task
    from asyncrl.tasks.rewards import build_reward

    cfg = load_config(args.config or None, args.overrides)
    cuda = torch.cuda.is_available()
    use_vllm = args.vllm == "on" or (args.vllm == "auto" and cuda)
    settings = trl_settings(cfg, cuda, use_vllm, args.micro_batch_seqs)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    chat = cfg.data.chat_template and bool(getattr(tokenizer, "chat_template", None))
    train = get_task(cfg.data.task).train_rows(cfg)
    held_out = load_eval_set(cfg)
    reward_fn = build_reward(cfg.reward)

    def reward(completions, answer, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(reward_fn(t, a)) for t, a in zip(texts, answer, strict=True)]

    reward.__name__ = cfg.reward.name
    dataset = train_dataset([{"prompt": [{"role": "user", "content": r.prompt}] if chat else r.prompt,
                              "answer": r.answer} for r in train])
    rows = Rows(out, t_launch)
    trainer = GRPOTrainer(model=cfg.model.path, reward_funcs=reward, train_dataset=dataset,
                          processing_class=tokenizer,
                          args=GRPOConfig(output_dir=str(out / "trainer"), **settings))
    prompt_ids = [encode_prompt(tokenizer, r.prompt, cfg.data.chat_template) for r in held_out]
    evaluate = make_evaluator(trainer, tokenizer, held_out, prompt_ids, reward_fn, cfg.generator.max_tokens,
                              rows, use_vllm)
    trainer.add_callback(make_callback(rows, evaluate, cfg.eval.every))
    (out / "train.json").write_text(json.dumps({"trl_settings": settings, "trl_ready_s": time.time() - t_launch},
                                               indent=1, default=str))
    try:
        trainer.train()
    except KeyboardInterrupt:
        print("stopped at the budget", flush=True)
    info = json.loads((out / "train.json").read_text())
    info["eval_s_excluded"] = round(rows.eval_s, 2)
    (out / "train.json").write_text(json.dumps(info, indent=1, default=str))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one TRL run with a wall-time budget")
    r.add_argument("--budget-s", type=float, default=400.0)
    r.add_argument("--config", default="configs/smollm2_arith.yaml")
    r.add_argument("--model", default="models/smollm2-135m-instruct")
    r.add_argument("--dtype", default="float32", help="the model folder's dtype (the trainer's master weights)")
    r.add_argument("--gguf", default="", help="a copy of the GGUF file instead of the installed package's")
    r.add_argument("--skip-convert", action="store_true", help="--model is a model folder already")
    r.add_argument("--vllm", choices=("auto", "on", "off"), default="auto",
                   help="generation by vLLM in the trainer's process (auto: on CUDA), or by transformers")
    r.add_argument("--name", default="", help="the run's folder under --out (default: the config's file name + _trl)")
    r.add_argument("--micro-batch-seqs", type=int, default=0,
                   help="sequences a forward/backward, gradients accumulated over a step (0: all of a step at once)")
    r.add_argument("--out", required=True)
    r.add_argument("overrides", nargs="*")
    r.set_defaults(fn=cmd_run)
    t = sub.add_parser("train", help="the training process `run` launches")
    t.add_argument("--config", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--vllm", choices=("auto", "on", "off"), default="auto")
    t.add_argument("--micro-batch-seqs", type=int, default=0)
    t.add_argument("overrides", nargs="*")
    t.set_defaults(fn=cmd_train)
    args = parser.parse_args()
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
