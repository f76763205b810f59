#!/usr/bin/env bash
# A Debian bookworm base image made here from the Debian archive (no registry needed), tagged as the name the
# Dockerfile's BASE_IMAGE expects. Idempotent: does nothing when the image exists.
#
#   bash scripts/image/base.sh [NAME]        default NAME: debian:bookworm-slim
set -euo pipefail
NAME=${1:-debian:bookworm-slim}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$(cd "$(dirname "$0")" && pwd)/containers.conf}
if podman image exists "$NAME"; then
    echo "base image $NAME is there"
    exit 0
fi
# the mirror apt already uses (deb822 sources, or the one-line format)
MIRROR=$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')
MIRROR=${MIRROR:-$(grep -hoE '^deb +\S+' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d)
trap 'rm -rf "$ROOTFS"' EXIT
echo "debootstrap --variant=minbase bookworm from $MIRROR"
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" >/dev/null
# what a slim image leaves out: documentation, manual pages, translations, package lists
rm -rf "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/* \
    "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | podman import --change 'CMD ["/bin/bash"]' - "$NAME" >/dev/null
echo "base image $NAME: $(podman image inspect "$NAME" --format '{{.Size}}') bytes"
