#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Proves a GPU bundle (scripts/gpu-bundle.sh) here, before any GPU is needed,
# so that "library not found" can never be the first finding on the GPU
# machine:
#  1. every executable and library in it resolves each shared library it
#     needs inside the bundle, except the C and C++ runtimes, the CUDA driver
#     and NCCL (which the GPU machine has); no RUNPATH names a path outside it;
#  2. its programs run from it in an empty environment (env -i): the GPU tests
#     start and skip for want of a GPU, the step benchmark runs 2 CPU nodes,
#     microd serves a 1-node job, microctl
#     reads its status, and the bundle's Python package under this machine's
#     interpreter allreduces through the bundle's libmicrod and microd.
#   scripts/gpu-bundle-check.sh [BUNDLE]     (default build/gpu-bundle)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
B="$(cd "${1:-$ROOT/build/gpu-bundle}" && pwd)"
fail() { echo "gpu-bundle-check: $*" >&2; exit 1; }
allowed() {
  case "${1##*/}" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*) return 0 ;;
    libstdc++.so.*|libgcc_s.so.*|libcuda.so.*|libnccl.so.*) return 0 ;;
  esac
  return 1
}

# 1. Resolution and RUNPATHs.
elves=0
while IFS= read -r f; do
  file -b "$f" | grep -q '^ELF' || continue
  elves=$((elves + 1))
  rpath=$(readelf -d "$f" | sed -n 's/.*(\(RPATH\|RUNPATH\)).*\[\(.*\)\]/\2/p')
  for p in ${rpath//:/ }; do
    [[ "$p" == '$ORIGIN'* ]] || fail "$f: RUNPATH entry $p is not relative to the bundle"
  done
  while read -r name path; do
    [[ -z "$name" ]] && continue
    if allowed "$name"; then continue; fi
    [[ "$path" == "$B"/* ]] || fail "$f: $name resolves to ${path:-nothing}, outside the bundle"
  done < <(env -i ldd "$f" 2>/dev/null | awk '/=>/ {print $1, $3} !/=>/ && /\.so/ {print $1, ""}')
done < <(find "$B" -type f \( -perm -u+x -o -name '*.so*' \))
echo "gpu-bundle-check: $elves ELF files, every library resolved inside the bundle or allowed"

# 2. The programs run from the bundle in an empty environment.
scratch=$(mktemp -d)
daemon_pid=""
cleanup() {
  local rc=$?
  if [[ -n "$daemon_pid" ]]; then
    kill "$daemon_pid" 2>/dev/null
    wait "$daemon_pid" 2>/dev/null || true
  fi
  # The daemon must not outlive the check (it once did: the pid killed was a
  # subshell's, and every CI run left a microd behind).
  if pgrep -f -- "--socket=$scratch/microd.sock" >/dev/null; then
    pkill -f -- "--socket=$scratch/microd.sock" || true
    echo "gpu-bundle-check: FAILED: the bundle's microd outlived the check" >&2
    [[ $rc -ne 0 ]] || rc=1
  fi
  rm -rf "$scratch"
  exit "$rc"
}
trap cleanup EXIT
clean() { env -i PATH=/usr/bin:/bin HOME="$scratch" MICROD_BUILD_DIR="$B" "$@"; }
for t in kernels_cuda_ops_test integration_daemon_cuda_test client_cuda_driver_abi_test; do
  clean "$B/tests/$t" --gtest_brief=1 >"$scratch/$t.log" 2>&1 ||
    { tail -20 "$scratch/$t.log"; fail "$t did not run from the bundle"; }
done
# transport_nccl_test needs libnccl.so.2, which only the GPU machine has: it
# must fail to load for that reason alone.
if ! clean "$B/tests/transport_nccl_test" --gtest_list_tests >"$scratch/nccl.log" 2>&1; then
  grep -q "libnccl.so.2" "$scratch/nccl.log" ||
    { cat "$scratch/nccl.log"; fail "transport_nccl_test fails to start for another reason"; }
fi
# The step benchmark: its CPU mode (Gloo) through 2 processes, where NCCL loads.
if clean "$B/bench/microd-bench-transport" --nodes=2 --size=100003 --warmup=1 --reps=1 \
    --dense_reps=1 >"$scratch/bench.log" 2>&1; then
  grep -q "micro (hist)" "$scratch/bench.log" ||
    { cat "$scratch/bench.log"; fail "microd-bench-transport printed no step"; }
else
  grep -q "libnccl.so.2" "$scratch/bench.log" ||
    { cat "$scratch/bench.log"; fail "microd-bench-transport failed from the bundle"; }
fi
# Not through clean(): backgrounded, a function runs in a subshell whose pid
# $! would be; env execs microd, so $! is the daemon's own.
env -i PATH=/usr/bin:/bin HOME="$scratch" "$B/daemon/microd" --socket="$scratch/microd.sock" --nodes=1 \
  --coordinator_listen=127.0.0.1:0 --admin=127.0.0.1:0 --admin_port_file="$scratch/admin" \
  --transport=gloo >"$scratch/microd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 200); do [[ -s "$scratch/admin" && -S "$scratch/microd.sock" ]] && break; sleep 0.05; done
[[ -S "$scratch/microd.sock" ]] || { cat "$scratch/microd.log"; fail "microd did not start from the bundle"; }
clean "$B/daemon/microctl" --admin="127.0.0.1:$(cat "$scratch/admin")" status >"$scratch/status" ||
  fail "microctl could not read the bundle's daemon"
grep -q "job  *running" "$scratch/status" || { cat "$scratch/status"; fail "the job is not running"; }
clean PYTHONPATH="$B/source/client/python" MICROD_LIBRARY="$B/client/libmicrod.so" \
  /usr/bin/python3 - "$scratch/microd.sock" <<'EOF' || fail "the bundle's Python package did not allreduce"
import sys
import numpy as np
import microd
c = microd.Client(sys.argv[1])
b = c.register("check", 1000)
b.array[:] = np.arange(1000, dtype=np.float32)
c.allreduce(b)
assert np.array_equal(b.array, np.arange(1000, dtype=np.float32)), b.array[:4]
print("python: allreduce through the bundle's libmicrod and microd: ok")
EOF
echo "gpu-bundle-check: the bundle's programs run from it in an empty environment"
echo "gpu-bundle-check: $(du -sh "$B" | cut -f1) in all"
