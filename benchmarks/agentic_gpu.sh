#!/usr/bin/env bash
# Agentic RL on one GPU: five SmolLM2-135M-Instruct runs side by side on the same GPU, each stopped
# BUDGET_S seconds after its launch (vLLM's start included):
#   calc_async          configs/calc.yaml with one worked exchange (env.examples=1), run.mode=async
#   calc_sync           the same in run.mode=sync
#   calc_notools_async  the same multiplications without the tool (env.tools=false), async
#   calc2_async         configs/calc.yaml as shipped (both worked exchanges), async
#   guess_async         configs/guess.yaml (guess a number, higher/lower replies), async
# One worked exchange leaves the base model calling the calculator on a few problems in ten
# (benchmarks/first_turn_tools.py): room to learn the tool. Each run gets a fifth of the CPUs (taskset),
# compile caches of its own and a fixed KV cache (generator.kv_cache_memory_gb), so that one engine's
# start does not size itself by another's memory, and micro-batches of 4,096 tokens (a learner sizes its
# own from the memory free when it starts, which five learners on one GPU would each count as theirs).
# Then two reports (benchmarks/smollm2_curve.py): a results JSON and PNGs for each task.
#
#   bash benchmarks/agentic_gpu.sh OUT [BUDGET_S] [GGUF]     # OUT/done is written when all is finished
set -euo pipefail
out=$(realpath -m "${1:?usage: agentic_gpu.sh OUT [BUDGET_S] [GGUF]}")
budget=${2:-600}
gguf=${3:-}
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
rm -f "$out/done"
model=$out/smollm2-135m-instruct
$py -m asyncrl model smollm2 --out "$model" --dtype float32 ${gguf:+--gguf "$gguf"}
ncpu=$(nproc)
q=$((ncpu / 5 > 0 ? ncpu / 5 : 1))
common=(run.max_steps=100000 run.stall_timeout_s=0 logging.prometheus=false checkpoint.export_hf=false
        generator.kv_cache_memory_gb=4 learner.micro_batch_tokens=4096)

arm() {  # slot name config mode [overrides...]
  local slot=$1 name=$2 config=$3 mode=$4
  shift 4
  local cache=$out/cache/$name lo=$(((slot * q) % ncpu))
  mkdir -p "$cache"
  VLLM_CACHE_ROOT=$cache/vllm TRITON_CACHE_DIR=$cache/triton TORCHINDUCTOR_CACHE_DIR=$cache/inductor \
    taskset -c "$lo-$((lo + q - 1))" "$py" "$here/smollm2_curve.py" run --mode "$mode" --name "$name" \
    --config "$config" --budget-s "$budget" --model "$model" ${gguf:+--gguf "$gguf"} --runs "$out/runs" \
    --out "$out/curves" "${common[@]}" "$@" >"$out/$name.log" 2>&1 &
}
arm 0 calc_async configs/calc.yaml async env.examples=1
arm 1 calc_sync configs/calc.yaml sync env.examples=1
arm 2 calc_notools_async configs/calc.yaml async env.examples=1 env.tools=false
arm 3 calc2_async configs/calc.yaml async
arm 4 guess_async configs/guess.yaml async
wait

c=$out/curves
$py "$here/smollm2_curve.py" report "$c/calc_async" "$c/calc_sync" "$c/calc_notools_async" "$c/calc2_async" \
  --labels async,sync,async_no_tool,async_2_examples --benchmark agentic_calc --title "calculator (3x2-digit products)" \
  --task "3-digit by 2-digit multiplication with a calculator tool, greedy held-out episodes" \
  --thresholds 0.1,0.2,0.3,0.4,0.5,0.6 --device "${DEVICE:-GPU}" \
  --json "$out/agentic_calc.json" --png "$out/agentic_calc.png" --tool-png "$out/agentic_calc_tools.png"
$py "$here/smollm2_curve.py" report "$c/guess_async" --labels async --benchmark agentic_guess \
  --title "guess a number (1-100, 8 guesses)" --task "guess a number from 1 to 100 in 8 turns, greedy held-out episodes" \
  --thresholds 0.1,0.2,0.3,0.4,0.5,0.6 --device "${DEVICE:-GPU}" \
  --json "$out/agentic_guess.json" --png "$out/agentic_guess.png"
touch "$out/done"
