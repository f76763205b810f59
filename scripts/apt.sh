# Sourced by the install scripts (scripts/install_*.sh, scripts/image/install_podman.sh): Debian packages the tests or
# the image build need, installed once. Not run on its own.
#
#   apt_install WHO "what to do without apt-get" start|no-start PACKAGE...
#
# As root, or through sudo; the package lists are refreshed only when they do not know the first package (stale or
# empty lists); `no-start` keeps the installer from starting a packaged daemon (the tests start their own).

apt_install() {
    local who=$1 without_apt=$2 start=$3
    shift 3
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then
            sudo=sudo
        else
            echo "$who: $* missing and this user cannot install packages;" >&2
            echo "  fix: run as root, or install them yourself: apt-get install -y $*" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "$who: no apt-get here; $without_apt" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-cache policy "$1" 2>/dev/null | grep -q 'Candidate: [0-9]'; then
        $sudo apt-get update -qq
    fi
    local policy=/usr/sbin/policy-rc.d added=0 status=0
    if [ "$start" = no-start ] && [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
        $sudo chmod +x "$policy"
        added=1
    fi
    $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null || status=$?
    if [ "$added" -eq 1 ]; then
        $sudo rm -f "$policy"
    fi
    if [ "$status" -ne 0 ]; then
        echo "$who: apt-get install $* failed (exit $status)" >&2
        return "$status"
    fi
}
