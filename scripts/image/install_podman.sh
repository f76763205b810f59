#!/usr/bin/env bash
# podman, runc and debootstrap from Debian, for `make image` and `make image-test`. Idempotent.
set -euo pipefail
if ! { command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null; }; then
    source "$(dirname "$0")/../apt.sh"
    apt_install install_podman.sh "install podman, runc and debootstrap with your system's package manager" \
        start podman runc debootstrap uidmap
fi
command -v podman
