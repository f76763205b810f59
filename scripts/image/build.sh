#!/usr/bin/env bash
# `make image`: the CPU serving image from the project's Dockerfile, with nothing from outside but the package
# archives (Debian's and PyPI's, as this machine reaches them).
#
#   bash scripts/image/build.sh
# Settings (environment):
#   TAG=miaohui:0.1.0-cpu      the image's name
#   BASE_IMAGE=                a base image to build FROM (default: debian:bookworm-slim, made here when absent)
#   REPOSITORY=                the model repository baked in (default: $MIAOHUI_HOME/repository, built by
#                              `miaohui prepare` when it has no models)
#   ENGINE=podman              or docker
# Prints the image's size and its models' layer on the last lines.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=scripts/image
TAG=${TAG:-miaohui:0.1.0-cpu}
BASE_IMAGE=${BASE_IMAGE:-}
ENGINE=${ENGINE:-podman}
VENV=${VENV:-.venv}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/$HERE/containers.conf}
STAGE=var/image

if [ "$ENGINE" = "podman" ]; then
    bash "$HERE/install_podman.sh" >/dev/null
fi
if [ -z "$BASE_IMAGE" ]; then
    BASE_IMAGE=debian:bookworm-slim
    bash "$HERE/base.sh" "$BASE_IMAGE"
fi
if [ -z "${REPOSITORY:-}" ]; then
    REPOSITORY=$("$VENV/bin/python" -c "from miaohui.paths import repository_dir; print(repository_dir())")
    "$VENV/bin/miaohui" prepare --repository "$REPOSITORY"
fi
[ -d "$REPOSITORY" ] || { echo "REPOSITORY=$REPOSITORY is not a directory" >&2; exit 2; }

echo "staging $STAGE: the wheelhouse (pip wheel .[serve]) and the repository $REPOSITORY"
rm -rf "$STAGE/repository"
mkdir -p "$STAGE/wheels"
# the project's own wheel and every runtime dependency as wheels (pip's cache and the configured indexes; no torch)
rm -f "$STAGE"/wheels/miaohui-*.whl
"$VENV/bin/python" -m pip wheel -q --disable-pip-version-check -w "$STAGE/wheels" ".[serve]"
# pip evaluates environment markers with this interpreter, not the image's: Debian bookworm's python3 is 3.11.2, so
# what only applies below 3.11.3 is added here (redis: async-timeout)
"$VENV/bin/python" -m pip wheel -q --disable-pip-version-check -w "$STAGE/wheels" "async-timeout>=4.0.3"
cp -al "$REPOSITORY" "$STAGE/repository" 2>/dev/null || cp -a "$REPOSITORY" "$STAGE/repository"
started=$(date +%s)
"$ENGINE" build -q --format docker -f Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$TAG" "$STAGE" >/dev/null
echo "built $TAG in $(( $(date +%s) - started )) s"
# sizes: the whole image, and the models (the repository's layer) apart from the runtime
size=$("$ENGINE" image inspect "$TAG" --format '{{.Size}}')
models=$(du -sb "$STAGE/repository" | cut -f1)
echo "image $TAG: $((size / 1000000)) MB: runtime $(((size - models) / 1000000)) MB, models $((models / 1000000)) MB"
