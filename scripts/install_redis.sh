#!/usr/bin/env bash
# Installs redis-server (Debian package `redis-server`) for the tests of the shared dialogue session store
# (the tests start their own redis-server on a free localhost port). Idempotent: does nothing when
# redis-server is already on PATH. Prints its path on its last line.
#
#   bash scripts/install_redis.sh            # as root, or with sudo available
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    command -v redis-server
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_redis.sh: redis-server is missing and this user cannot install packages;" >&2
        echo "  fix: run as root, or install it yourself: apt-get install -y redis-server" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_redis.sh: no apt-get here; install redis-server (https://redis.io/downloads) and put it on PATH" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they do not know the package (stale or empty lists).
if ! apt-cache policy redis-server 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
# Keep the installer from starting the system's Redis service: the tests start their own.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    ADDED_POLICY=1
fi
status=0
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null || status=$?
if [ "$ADDED_POLICY" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
fi
if [ "$status" -ne 0 ]; then
    echo "install_redis.sh: apt-get install redis-server failed (exit $status)" >&2
    exit "$status"
fi
command -v redis-server
