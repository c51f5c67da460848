#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make test-asan / make test-tsan: builds microd with a sanitizer in a build
# folder of its own (CUDA and the benchmarks off) and runs the suites that
# exercise its own code: the unit tests, the transport contract, the
# end-to-end and hardening suites (daemons and C clients, all instrumented)
# and the fuzz replays. Not run: the Python and packaging tests (they load
# libmicrod into Debian's interpreter, which is not instrumented) and the
# long ones (make test-long runs them uninstrumented; CI's time: the
# emulated network's 18 tests took 286 s of the last CI run's ASan tests,
# about 2.5 of its 15 minutes at two at a time). The contract suite runs
# over plain Gloo and over sealed Gloo with a long link and 3 connections
# (the paths of the two variants between them: one connection sealed, 3
# unsealed; their code is the union's), and the step tests take one density
# per size: CI's ASan run stays near 10 minutes.
#   scripts/sanitize.sh address   ASan + UBSan, every report fatal (build-asan/)
#   scripts/sanitize.sh thread    TSan (build-tsan/); needs an abseil built with
#                                 TSan: with Debian's, every access under an
#                                 absl::Mutex is reported (docs/hardening.md)
set -euo pipefail
cd "$(dirname "$0")/.."
kind=${1:-}
case "$kind" in
  address) build=build-asan ;;
  thread) build=build-tsan ;;
  *) echo "usage: $0 address|thread" >&2; exit 2 ;;
esac
jobs=${JOBS:-$(nproc)}
start=$(date +%s)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMICROD_SANITIZE="$kind" \
  -DMICROD_ENABLE_CUDA=OFF -DMICROD_BUILD_BENCH=OFF >/dev/null
cmake --build "$build" -j "$jobs"
built=$(date +%s)
supp="$PWD/tests/sanitizer"
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
status=0
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900 -E '^(python_|deploy_)|^Gloo/TransportContractTest.* gloo_(3_connections|sealed)$' -LE long) || status=$?
echo "sanitize ($kind): build $((built - start)) s, tests $(( $(date +%s) - built )) s"
exit $status
