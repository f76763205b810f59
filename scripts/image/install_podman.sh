#!/usr/bin/env bash
# podman, runc and debootstrap from Debian, for `make image` and `make image-test`. Idempotent.
set -euo pipefail
if command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; then
    command -v podman
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "install_podman.sh: run as root, or: apt-get install -y podman runc debootstrap" >&2; exit 1; }
    SUDO=sudo
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-cache policy podman 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
$SUDO apt-get install -y -qq --no-install-recommends podman runc debootstrap uidmap >/dev/null
command -v podman
