#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make coverage: the share of each daemon module's lines that its unit tests
# run (gcov through lcov, Debian's). Builds the unit-test binaries with
# --coverage in a build folder of its own (build-cov/, CUDA and the
# benchmarks off), runs them (no daemon process, no Python: what a module's
# own tests reach, not the end-to-end suites), and writes
# build-cov/coverage.txt: lines covered per directory, and the total.
#   scripts/coverage.sh               every unit test
#   scripts/coverage.sh REGEX         only the test binaries matching REGEX
#   SKIP=REGEX scripts/coverage.sh    leave out the test binaries matching REGEX
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-cov
jobs=${JOBS:-$(nproc)}
only=${1:-}
skip=${SKIP:-}  # test binaries to leave out (a regex), e.g. to measure without one
bash scripts/install-deps.sh --coverage
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DMICROD_ENABLE_CUDA=OFF -DMICROD_BUILD_BENCH=OFF \
  -DCMAKE_C_FLAGS=--coverage -DCMAKE_CXX_FLAGS=--coverage -DCMAKE_EXE_LINKER_FLAGS=--coverage \
  -DCMAKE_SHARED_LINKER_FLAGS=--coverage >/dev/null
# The unit tests: one binary per module (tests/CMakeLists.txt), no helpers.
targets=$(grep -oE '^microd_add_gtest\((kernels_cpu|transport_inproc|sparsify|control|common|engine|daemon)[a-z_]*' \
  tests/CMakeLists.txt | sed 's/microd_add_gtest(//')
# shellcheck disable=SC2086
cmake --build "$build" -j "$jobs" --target $targets
find "$build" -name '*.gcda' -delete
status=0
: >"$build/tests.log"
for t in $targets; do
  if [ -n "$only" ] && ! [[ "$t" =~ $only ]]; then continue; fi
  if [ -n "$skip" ] && [[ "$t" =~ $skip ]]; then continue; fi
  "$build/tests/$t" >>"$build/tests.log" 2>&1 || { status=1; echo "coverage: $t failed" >&2; }
done
grep -E '^\[  (PASSED|FAILED)' "$build/tests.log" | sort | uniq -c
lcov --quiet --capture --directory "$build" --output-file "$build/all.info" \
  --rc lcov_branch_coverage=0 2>/dev/null
lcov --quiet --extract "$build/all.info" "$PWD/daemon/*" "$PWD/kernels/*" \
  --output-file "$build/microd.info" 2>/dev/null
# Lines covered per directory of daemon/ and kernels/.
{
  echo "Lines run by the unit tests ($(date -u +%F), scripts/coverage.sh ${only}${skip:+, SKIP=$skip})"
  lcov --list "$build/microd.info" 2>/dev/null | awk -F'|' '
    NF >= 2 && $1 ~ /\.(cc|h|cu)/ {
      file = $1; gsub(/ +$/, "", file)
      dir = file; sub(/\/[^\/]*$/, "", dir)
      split($2, a, " "); rate = a[1]; n = a[2]; sub(/%/, "", rate)
      if (n + 0 > 0) { hit[dir] += rate * n / 100; all[dir] += n }
    }
    END { for (d in all) printf "%-28s %6d of %6d lines  %5.1f %%\n", d, hit[d], all[d], 100 * hit[d] / all[d] }' \
    | sort
  lcov --summary "$build/microd.info" 2>&1 | grep -E 'lines'
} | tee "$build/coverage.txt"
exit $status
