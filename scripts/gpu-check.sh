#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks on a machine that has both a GPU and this project's build
# dependencies: builds the GPU bundle (scripts/gpu-bundle.sh) and runs it
# (the bundle's run.sh, scripts/gpu-run.sh). On a lent GPU machine, which
# lacks the dependencies, build the bundle here and run only its run.sh
# there (docs/gpu.md).
#   scripts/gpu-check.sh [gpu-bundle.sh options]     (results in $OUT, default build/gpu-check)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/gpu-bundle.sh" "$@"
OUT="${OUT:-$ROOT/build/gpu-check}" "$ROOT/build/gpu-bundle/run.sh"
