#!/usr/bin/env bash
# Installs promtool (Debian package `prometheus`) so the alert rules in deploy/prometheus can be checked
# and unit-tested (`promtool check rules`, `promtool test rules`). Idempotent: does nothing when promtool
# is already on PATH. Prints promtool's path on its last line.
#
#   bash scripts/install_prometheus.sh            # as root, or with sudo available
set -euo pipefail

if command -v promtool >/dev/null 2>&1; then
    command -v promtool
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_prometheus.sh: promtool is missing and this user cannot install packages;" >&2
        echo "  fix: run as root, or install it yourself: apt-get install -y prometheus" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prometheus.sh: no apt-get here; install promtool (https://prometheus.io/download) and put it on PATH" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they do not know the package (stale or empty lists).
if ! apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
# The package also ships the Prometheus daemon; keep the installer from starting it.
POLICY=/usr/sbin/policy-rc.d
ADDED_POLICY=0
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null
    $SUDO chmod +x "$POLICY"
    ADDED_POLICY=1
fi
status=0
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null || status=$?
if [ "$ADDED_POLICY" -eq 1 ]; then
    $SUDO rm -f "$POLICY"
fi
if [ "$status" -ne 0 ]; then
    echo "install_prometheus.sh: apt-get install prometheus failed (exit $status)" >&2
    exit "$status"
fi
command -v promtool
