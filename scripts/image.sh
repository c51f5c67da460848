#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make image: builds the Dockerfile with podman as microd:test (IMAGE=...),
# from Debian's own packages: the base images are made here when missing
# (scripts/podman-env.sh), nothing is pulled from a registry.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
source scripts/podman-env.sh
microd_podman_setup "$ROOT"
microd_base_images
IMAGE="${IMAGE:-microd:test}"
start=$(date +%s)
# --network host: the RUN steps reach this machine's apt mirror; --format
# docker keeps HEALTHCHECK.
podman build --pull=never --format docker --network host --build-arg JOBS="$(nproc)" \
  -t "$IMAGE" . >"$PODMAN_DIR/build.log" 2>&1 || {
  tail -30 "$PODMAN_DIR/build.log" >&2
  echo "image: podman build failed (log: $PODMAN_DIR/build.log)" >&2
  exit 1
}
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')
echo "image: $IMAGE built in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
