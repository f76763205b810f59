#!/usr/bin/env bash
# Installs redis-server (Debian package `redis-server`) for the tests of the shared dialogue session store
# (the tests start their own redis-server on a free localhost port). Idempotent: does nothing when
# redis-server is already on PATH. Prints its path on its last line.
#
#   bash scripts/install_redis.sh            # as root, or with sudo available
set -euo pipefail

if ! command -v redis-server >/dev/null 2>&1; then
    source "$(dirname "$0")/apt.sh"
    apt_install install_redis.sh "install redis-server (https://redis.io/downloads) and put it on PATH" \
        no-start redis-server
fi
command -v redis-server
