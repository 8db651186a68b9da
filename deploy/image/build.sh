#!/usr/bin/env bash
# Builds the gateway's image (Containerfile) with podman or buildah,
# whichever is installed, and prints its size.
#
#   deploy/image/build.sh [--local] [--tag IMAGE] [--base BASE_IMAGE]
#
# Default: from docker.io/library/python:3.11-slim, dependencies from PyPI.
# --local: for a machine without a reachable registry: the base is made here with
# debootstrap (deploy/image/local-base.sh, once), and the wheels are built outside
# with this machine's pip settings (index, CA bundle) into deploy/image/wheels/, then
# installed inside with --no-index.
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=localhost/llm-tail-gateway:latest
BASE=""
LOCAL=0
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case "$1" in
        --local) LOCAL=1 ;;
        --tag) TAG=$2; shift ;;
        --base) BASE=$2; shift ;;
        *) echo "build.sh: unknown argument $1 (--local, --tag IMAGE, --base IMAGE)" >&2; exit 2 ;;
    esac
    shift
done

if command -v podman >/dev/null 2>&1; then
    BUILD=(podman build --isolation chroot)
elif command -v buildah >/dev/null 2>&1; then
    BUILD=(buildah bud --isolation chroot --layers)
else
    echo "build.sh: neither podman nor buildah is installed (apt-get install -y buildah)" >&2
    exit 1
fi

ARGS=(-f Containerfile -t "$TAG")
find deploy/image/wheels -name '*.whl' -delete
if [ "$LOCAL" = 1 ]; then
    BASE=${BASE:-localhost/debian-python:3.11}
    deploy/image/local-base.sh "$BASE"
    # setuptools: the build backend pip needs for /src with no index inside;
    # async-timeout: redis needs it on Debian 12's Python 3.11.2 (< 3.11.3), which the
    # machine's own Python may not be, so `pip wheel .` alone leaves it out.
    "$PYTHON" -m pip wheel --quiet --wheel-dir deploy/image/wheels . 'setuptools>=77' 'async-timeout>=4.0.3'
    ARGS+=(--build-arg PIP_NO_INDEX=1)
fi
[ -n "$BASE" ] && ARGS+=(--build-arg "BASE_IMAGE=$BASE")

started=$SECONDS
"${BUILD[@]}" "${ARGS[@]}" . || {
    status=$?
    find deploy/image/wheels -name '*.whl' -delete
    [ "$LOCAL" = 1 ] || echo "build.sh: the build failed; with no reachable registry, build with --local" \
        "(make image IMAGE_ARGS=--local)" >&2
    exit "$status"
}
find deploy/image/wheels -name '*.whl' -delete
# The build stage and the image this tag replaced are left untagged (~420 MB a build):
# prune dangling images so repeated builds (the image test) do not fill the disk.
if [ "${BUILD[0]}" = podman ]; then podman image prune -f >/dev/null; else buildah rmi --prune >/dev/null; fi
size=$(buildah images --format '{{.Size}}' "$TAG" 2>/dev/null || true)
echo "build.sh: built $TAG in $((SECONDS - started)) s${size:+, $size}"
