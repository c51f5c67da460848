#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The load-sensitive suites run LOOPS times (default 20) beside two busy
# neighbours (a shell loop each: this machine has two cores), one ctest -j2
# a loop; a line per loop, the failures named with their output kept, and
# the count at the end (exit 1 if any). A flake found here gets a
# regression test.
#   scripts/flake-loop.sh [--build DIR] [--loops N] [--regex RE]
set -euo pipefail
cd "$(dirname "$0")/.."
build=build
loops=20
regex='^(Hardening|DaemonElastic|BatchedRounds|GlooTransportTest|NetLabTest|DaemonEndToEnd)\.'
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --loops) loops=$2; shift 2 ;;
    --regex) regex=$2; shift 2 ;;
    *) echo "usage: $0 [--build DIR] [--loops N] [--regex RE]" >&2; exit 2 ;;
  esac
done
[ -d "$build" ] || { echo "$0: no build folder $build (make build first)" >&2; exit 2; }
# Each neighbour ends on its own after the longest the loops may take.
limit=$((loops * 900))
timeout "$limit" sh -c 'while :; do :; done' & hog1=$!
timeout "$limit" sh -c 'while :; do :; done' & hog2=$!
trap 'kill $hog1 $hog2 2>/dev/null || true' EXIT
failed=0
log=$(mktemp -d)
for i in $(seq 1 "$loops"); do
  start=$(date +%s)
  if (cd "$build" && ctest -j2 --timeout 600 --output-on-failure -R "$regex" >"$log/loop$i.log" 2>&1); then
    echo "loop $i: passed ($(( $(date +%s) - start )) s)"
    rm -f "$log/loop$i.log"
  else
    failed=$((failed + 1))
    echo "loop $i: FAILED ($(( $(date +%s) - start )) s): $(grep -E '^\s+[0-9]+ - ' "$log/loop$i.log" |
      sed -E 's/^\s+[0-9]+ - //' | tr '\n' ' ') (output: $log/loop$i.log)"
  fi
done
echo "flake loop: $failed of $loops loops failed (regex $regex, build $build)"
[ "$failed" -eq 0 ]
