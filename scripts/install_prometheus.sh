#!/usr/bin/env bash
# Installs promtool (Debian package `prometheus`) so the alert rules in deploy/prometheus can be checked
# and unit-tested (`promtool check rules`, `promtool test rules`). Idempotent: does nothing when promtool
# is already on PATH. Prints promtool's path on its last line.
#
#   bash scripts/install_prometheus.sh            # as root, or with sudo available
set -euo pipefail

if ! command -v promtool >/dev/null 2>&1; then
    source "$(dirname "$0")/apt.sh"
    # the package also ships the Prometheus daemon: not started
    apt_install install_prometheus.sh "install promtool (https://prometheus.io/download) and put it on PATH" \
        no-start prometheus
fi
command -v promtool
