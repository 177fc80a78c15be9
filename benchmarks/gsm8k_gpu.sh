#!/usr/bin/env bash
# GRPO on GSM8K with a real model on one GPU, asyncrl against TRL's GRPOTrainer (vLLM colocate) on the
# same config, each arm stopped BUDGET seconds after its launch (start-up included), in stages that can
# be run separately:
#
#   bash benchmarks/gsm8k_gpu.sh setup OUT GGUF GSM8K_DIR   # OUT/model from the GGUF (float32), OUT/data
#   bash benchmarks/gsm8k_gpu.sh arm OUT async BUDGET [overrides...]    # asyncrl, run.mode=async
#   bash benchmarks/gsm8k_gpu.sh arm OUT sync BUDGET [overrides...]     # asyncrl, run.mode=sync
#   bash benchmarks/gsm8k_gpu.sh arm OUT trl BUDGET [overrides...]      # TRL GRPOTrainer, 16 sequences a
#                                                                       # forward/backward, accumulated to a step
#   bash benchmarks/gsm8k_gpu.sh base OUT [NUM_PROMPTS]     # greedy accuracy of the model before training
#   bash benchmarks/gsm8k_gpu.sh report OUT [LABELS]        # OUT/gsm8k.json and OUT/gsm8k.png
#
# CONFIG (default configs/gsm8k_qwen2.5_coder_0.5b.yaml), MODEL_NAME and DEVICE name what runs. GSM8K_DIR
# holds train.parquet and test.parquet (`asyncrl data gsm8k --src FOLDER --out GSM8K_DIR`). Each arm writes
# OUT/curves/<mode>/ (metrics.jsonl, eval.jsonl, launch.json) and OUT/<mode>.log.
set -euo pipefail
stage=${1:?usage: gsm8k_gpu.sh setup|arm|base|report OUT ...}
out=$(realpath -m "${2:?usage: gsm8k_gpu.sh STAGE OUT ...}")
shift 2
py=${PYTHON:-python3}
here=$(cd "$(dirname "$0")" && pwd)
config=${CONFIG:-configs/gsm8k_qwen2.5_coder_0.5b.yaml}
model=$out/model
data=(data.path="$out/data/train.parquet" model.path="$model")
mkdir -p "$out"
case $stage in
  setup)
    gguf=${1:?setup needs GGUF}; src=${2:?setup needs GSM8K_DIR}
    $py -m asyncrl model from-gguf "$gguf" --out "$model" --dtype float32
    mkdir -p "$out/data" && cp "$src"/train.parquet "$src"/test.parquet "$out/data/"
    ;;
  arm)
    mode=${1:?arm needs async|sync|trl}; budget=${2:?arm needs BUDGET}
    shift 2
    common=(run.stall_timeout_s=0 logging.prometheus=false "${data[@]}")
    if [ "$mode" = trl ]; then
      $py "$here/trl_grpo.py" run --skip-convert --model "$model" --config "$config" --budget-s "$budget" \
        --micro-batch-seqs "${TRL_MICRO_SEQS:-16}" --name trl --out "$out/curves" "${common[@]}" "$@" \
        >"$out/trl.log" 2>&1
    else
      $py "$here/smollm2_curve.py" run --skip-convert --model "$model" --mode "$mode" --name "$mode" \
        --config "$config" --budget-s "$budget" --runs "$out/runs" --out "$out/curves" "${common[@]}" "$@" \
        >"$out/$mode.log" 2>&1
    fi
    ;;
  base)
    $py "$here/base_accuracy.py" "$config" "${data[@]}" "eval.num_prompts=${1:-1319}" --show 3 \
      --out "$out/base.json" >"$out/base.log" 2>&1
    ;;
  report)
    labels=${1:-async,trl}
    runs=(); for l in ${labels//,/ }; do runs+=("$out/curves/$l"); done
    $py "$here/smollm2_curve.py" report "${runs[@]}" --labels "$labels" --benchmark gsm8k \
      --model-name "${MODEL_NAME:-Qwen2.5-Coder-0.5B-Instruct}" --title "GSM8K" --device "${DEVICE:-GPU}" \
      --task "GSM8K, greedy accuracy on the first 500 test questions" --thresholds 0.3,0.4,0.5,0.6 \
      --json "$out/gsm8k.json" --png "$out/gsm8k.png"
    ;;
  *) echo "unknown stage $stage (setup, arm, base, report)" >&2; exit 2 ;;
esac
