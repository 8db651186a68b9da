#!/usr/bin/env bash
# The routers scripts/bench_peers.py puts beside the gateway, installed into their own
# virtualenv (they are not dependencies of the gateway): vllm-router and smg (SGLang
# Model Gateway), both Rust binaries from PyPI, at pinned versions.
#
#     scripts/peers.sh                 # into .venv-peers in the repository
#     VENV=/some/where scripts/peers.sh
#     PYTHON=python3.12 scripts/peers.sh
#
# Idempotent: when both are already there at these versions it installs nothing.
# Prints the two binaries' paths, one a line (vllm-router first); the rest goes to stderr.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-peers}"
PYTHON="${PYTHON:-python3}"
VLLM_ROUTER_VERSION="0.1.17"
SMG_VERSION="1.13.0"

installed_version() {  # the version pip reports for package $1 in the venv, or nothing
    "$VENV/bin/python" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'
}

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi

if [[ "$(installed_version vllm-router)" == "$VLLM_ROUTER_VERSION" \
    && "$(installed_version smg)" == "$SMG_VERSION" \
    && -x "$VENV/bin/vllm-router" && -x "$VENV/bin/smg" ]]; then
    echo "vllm-router $VLLM_ROUTER_VERSION and smg $SMG_VERSION already in $VENV" >&2
else
    echo "installing vllm-router==$VLLM_ROUTER_VERSION smg==$SMG_VERSION into $VENV" >&2
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
        "vllm-router==$VLLM_ROUTER_VERSION" "smg==$SMG_VERSION" >&2
fi

for binary in vllm-router smg; do
    if [[ ! -x "$VENV/bin/$binary" ]]; then
        echo "error: $VENV/bin/$binary is missing after the install" >&2
        exit 1
    fi
    echo "$VENV/bin/$binary"
done
