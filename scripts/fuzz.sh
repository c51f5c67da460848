#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make fuzz: the fuzz targets of tests/fuzz under libFuzzer (clang, ASan +
# UBSan, every library instrumented for coverage), each for FUZZ_SECONDS
# (default 120) on one core, starting from the committed seeds
# (tests/fuzz/corpus/TARGET) plus what earlier runs found
# (build-fuzz/corpus/TARGET). Crashing inputs go to build-fuzz/findings/TARGET;
# copy the interesting ones into tests/fuzz/corpus so that make test replays
# them. Prints each target's executions and findings.
#   FUZZ_SECONDS=600 make fuzz      FUZZ_TARGETS="coordinator" make fuzz
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --fuzz
build=build-fuzz
seconds=${FUZZ_SECONDS:-120}
targets=${FUZZ_TARGETS:-"local_protocol coordinator step_inputs"}
CC=clang CXX=clang++ cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMICROD_SANITIZE=address -DMICROD_FUZZ=ON -DMICROD_ENABLE_CUDA=OFF -DMICROD_BUILD_BENCH=OFF \
  >/dev/null
for t in $targets; do
  cmake --build "$build" -j "${JOBS:-$(nproc)}" --target "microd-fuzz-$t"
done
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/sanitizer/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
failed=0
summary=()
for t in $targets; do
  corpus="$build/corpus/$t"
  findings="$build/findings/$t"
  mkdir -p "$corpus" "$findings"
  log="$build/fuzz-$t.log"
  rc=0
  "$build/tests/fuzz/microd-fuzz-$t" "$corpus" "tests/fuzz/corpus/$t" \
    -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="$findings/" >"$log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  found=$(find "$findings" -type f | wc -l)
  summary+=("$t: ${execs:-?} executions in ${seconds} s, corpus $(find "$corpus" -type f | wc -l) inputs, ${found} findings (rc $rc, log $log)")
  if [[ $rc -ne 0 || $found -ne 0 ]]; then failed=1; fi
done
printf 'fuzz: %s\n' "${summary[@]}"
exit $failed
