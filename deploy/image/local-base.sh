#!/usr/bin/env bash
# Makes a local base image for the Containerfile when no registry is reachable
# (python:3.11-slim cannot be pulled): Debian 12's minimal root filesystem with
# Python 3.11 from Debian's own packages, made with debootstrap and committed with
# buildah. Needs root, debootstrap and buildah; the Debian mirror apt already uses.
#
#   deploy/image/local-base.sh [IMAGE]     # default localhost/debian-python:3.11
#
# Idempotent: an image already there is kept (debootstrap takes minutes), so the
# image test and `make image-local` pay for it once per machine.
set -euo pipefail
IMAGE=${1:-localhost/debian-python:3.11}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=${DEBIAN_SUITE:-bookworm}

if buildah inspect --type image "$IMAGE" >/dev/null 2>&1; then
    echo "local-base: $IMAGE is already there"
    exit 0
fi
for tool in debootstrap buildah; do
    command -v "$tool" >/dev/null 2>&1 || PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null 2>&1 || {
        echo "local-base: $tool is missing (apt-get install -y $tool)" >&2
        exit 1
    }
done
PATH="$PATH:/usr/sbin"

work=$(mktemp -d /var/tmp/local-base.XXXXXX)
trap 'rm -rf "$work"' EXIT
started=$SECONDS
# python3-venv brings ensurepip's pip wheel: the build stage makes its venv with it.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$work/rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    echo "local-base: debootstrap failed" >&2
    exit 1
}
# What an image does not need: apt's lists and caches, docs, man pages, locales.
rm -rf "$work"/rootfs/var/lib/apt/lists/* "$work"/rootfs/var/cache/apt/*.bin \
    "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/usr/share/doc/* \
    "$work"/rootfs/usr/share/man/* "$work"/rootfs/usr/share/info/*
find "$work/rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C.*' -exec rm -rf {} + 2>/dev/null || true

tar -C "$work/rootfs" -cf "$work/rootfs.tar" .
ctr=$(buildah from scratch)
buildah add "$ctr" "$work/rootfs.tar" / >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /usr/bin/python3 "$ctr"
buildah commit --quiet --rm "$ctr" "$IMAGE" >/dev/null
echo "local-base: made $IMAGE in $((SECONDS - started)) s"
