#!/usr/bin/env bash
# Installs Debian's headless Chromium and its WebDriver (packages `chromium`, `chromium-driver`) and a CJK font, so
# the web console's browser test (tests/e2e/test_console.py, selenium) can run and its screenshots show Chinese.
# Idempotent: does nothing when chromium and chromedriver are already on PATH. Prints chromedriver's path last.
#
#   bash scripts/install_browser.sh            # as root, or with sudo available
set -euo pipefail

if ! command -v chromedriver >/dev/null 2>&1 || ! { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then
    source "$(dirname "$0")/apt.sh"
    apt_install install_browser.sh "install Chromium and a matching chromedriver and put both on PATH" \
        start chromium-driver chromium fonts-noto-cjk
fi
command -v chromedriver
