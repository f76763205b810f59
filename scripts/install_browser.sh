#!/usr/bin/env bash
# Installs Debian's headless Chromium and its WebDriver (packages `chromium`, `chromium-driver`) and a CJK font, so
# the web console's browser test (tests/e2e/test_console.py, selenium) can run and its screenshots show Chinese.
# Idempotent: does nothing when chromium and chromedriver are already on PATH. Prints chromedriver's path last.
#
#   bash scripts/install_browser.sh            # as root, or with sudo available
set -euo pipefail

if command -v chromedriver >/dev/null 2>&1 && { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then
    command -v chromedriver
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_browser.sh: chromium/chromedriver are missing and this user cannot install packages;" >&2
        echo "  fix: run as root, or install them yourself: apt-get install -y chromium chromium-driver fonts-noto-cjk" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser.sh: no apt-get here; install Chromium and a matching chromedriver and put both on PATH" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when they do not know the package (stale or empty lists).
if ! apt-cache policy chromium-driver 2>/dev/null | grep -q 'Candidate: [0-9]'; then
    $SUDO apt-get update -qq
fi
status=0
$SUDO apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-noto-cjk >/dev/null || status=$?
if [ "$status" -ne 0 ]; then
    echo "install_browser.sh: apt-get install chromium chromium-driver failed (exit $status)" >&2
    exit "$status"
fi
command -v chromedriver
