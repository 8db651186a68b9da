#!/usr/bin/env bash
# The tail benchmark against a real llama.cpp server (see real_backend.sh); not part of CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8001}
PARALLEL=${PARALLEL:-4}
PY=${PY:-.venv/bin/python}
PORT=$PORT PARALLEL=$PARALLEL scripts/real_backend.sh > results/real_backend.log 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for _ in $(seq 1 1200); do  # the first run builds llama.cpp: allow 20 minutes
  if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
  if ! kill -0 $server 2>/dev/null; then echo "llama-server failed: see results/real_backend.log" >&2; exit 1; fi
  sleep 1
done
"$PY" scripts/bench_tail.py --backend "http://127.0.0.1:$PORT" --slots "$PARALLEL" \
  --model gemma --ignore-eos --mix config/mix-real.toml --out results/bench_real "$@"
