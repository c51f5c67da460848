#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks, run on a GPU machine from the bundle of
# scripts/gpu-bundle.sh (this file is the bundle's run.sh). One command,
# sized for one H200 and under 8 minutes in all: every phase has a limit and
# the run stops starting phases when the total would pass it. Everything goes
# to $OUT as it happens; $OUT/summary.txt is written first and after every
# phase, so a run killed at any point still says what it did. A skipped test
# counts as a failure here.
#
#   OUT=/some/dir build/gpu-bundle/run.sh      (OUT defaults to <bundle>/out)
#
# Phases: preflight (the GPU, its compute mode, a CUDA IPC round trip
# between two processes, NCCL and its version), the CUDA kernel tests, the
# CUDA driver ABI test, the NCCL contract suite (ranks 1, 2, 4; under MPS
# when the machine has it), CUDA buffers through the daemons (staged and
# --transport=nccl), the Python CUDA tests with the machine's PyTorch, the
# kernel benchmark at d = 25,557,032 and 1e9 beside the e += g floor and
# torch.topk, the device-resident step (25,557,032 floats, 2 NCCL ranks on
# the one GPU) beside NCCL's dense allreduce, with its host waits per step.
set -uo pipefail
BUNDLE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$BUNDLE/out}"
mkdir -p "$OUT"
TOTAL_LIMIT=${GPU_RUN_LIMIT_S:-470}
START=$(date +%s)
SUMMARY="$OUT/summary.txt"
RESULTS=()
FAILED=0
elapsed() { echo $(( $(date +%s) - START )); }
write_summary() {
  {
    echo "microd GPU checks, bundle $(cat "$BUNDLE/REVISION" 2>/dev/null), $(date -u +%FT%TZ)"
    echo "elapsed $(elapsed) s of at most $TOTAL_LIMIT s; ${1:-running}"
    printf '%s\n' "${RESULTS[@]}"
  } >"$SUMMARY"
}
record() {  # name status detail
  RESULTS+=("$(printf '%-28s %-8s %s' "$1" "$2" "$3")")
  [[ "$2" == "ok" ]] || FAILED=1
  write_summary
}
# Time left for a phase: its own limit, or less when the total is near.
budget() {
  local want=$1 left=$(( TOTAL_LIMIT - $(elapsed) ))
  (( left < want )) && want=$left
  echo "$want"
}
write_summary

export MICROD_BUILD_DIR="$BUNDLE"  # tests find their helpers here (tests/helper_path.h)
export MICROD_LIBRARY="$BUNDLE/client/libmicrod.so"
PYTHON="$(command -v python3 || true)"

# --- preflight ------------------------------------------------------------
{
  echo "== nvidia-smi"
  nvidia-smi --query-gpu=name,driver_version,compute_mode,memory.total --format=csv 2>&1
  echo "PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-(unset)}"
} >"$OUT/preflight.log" 2>&1
if ! nvidia-smi -L >>"$OUT/preflight.log" 2>&1; then
  record preflight FAILED "no GPU visible (nvidia-smi)"
  write_summary "done: FAILED"
  exit 1
fi
compute_mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
# NCCL: the machine's (the nvidia-nccl wheel's, or a system one).
NCCL_DIR=""
if [[ -n "$PYTHON" ]]; then
  NCCL_DIR=$("$PYTHON" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
fi
if [[ -z "$NCCL_DIR" || ! -e "$NCCL_DIR/libnccl.so.2" ]]; then
  NCCL_DIR=$(ldconfig -p 2>/dev/null | awk '/libnccl.so.2 / {print $NF; exit}' | xargs -r dirname)
fi
nccl_version="none"
if [[ -n "$NCCL_DIR" && -e "$NCCL_DIR/libnccl.so.2" ]]; then
  export LD_LIBRARY_PATH="$NCCL_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  nccl_version=$("$PYTHON" - "$NCCL_DIR/libnccl.so.2" <<'EOF' 2>/dev/null || echo "?"
import ctypes, sys
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print(f"{v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}")
EOF
)
fi
echo "NCCL: ${NCCL_DIR:-not found} version $nccl_version" >>"$OUT/preflight.log"
# A CUDA IPC round trip between two processes (what the daemon does with a
# trainer's buffers): PyTorch shares CUDA tensors with cudaIpcGetMemHandle /
# cudaIpcOpenMemHandle.
ipc="not tried (no python3 with CUDA-enabled torch)"
if [[ -n "$PYTHON" ]] && timeout 60 "$PYTHON" - >>"$OUT/preflight.log" 2>&1 <<'EOF'
import torch, torch.multiprocessing as mp
def child(t, q):
    t.add_(1.0)
    torch.cuda.synchronize()
    q.put(float(t.sum()))
if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    t = torch.zeros(1024, device="cuda")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(t, q))
    p.start()
    got = q.get(timeout=50)
    p.join(10)
    assert got == 1024.0 and float(t.sum()) == 1024.0, (got, float(t.sum()))
    print("CUDA IPC round trip between two processes: ok")
EOF
then ipc="ok"; else ipc="FAILED (see preflight.log)"; fi
if [[ "$ipc" == ok && "$nccl_version" != none ]]; then
  record preflight ok "compute mode $compute_mode, IPC $ipc, NCCL $nccl_version"
else
  record preflight FAILED "compute mode $compute_mode, IPC $ipc, NCCL $nccl_version"
fi

# --- GoogleTest phases ------------------------------------------------------
run_gtest() {  # name limit [args]
  local name="$1" limit
  limit=$(budget "$2")
  shift 2
  if (( limit < 5 )); then record "$name" "NOT RUN" "no time left"; return; fi
  timeout --kill-after=5 "$limit" "$BUNDLE/tests/$name" --gtest_color=no "$@" \
    >"$OUT/$name.log" 2>&1
  local rc=$?
  local passed failed skipped
  passed=$(grep -c "^\[       OK \]" "$OUT/$name.log")
  failed=$(grep -c "^\[  FAILED  \].*(" "$OUT/$name.log")
  skipped=$(grep -c "^\[  SKIPPED \]" "$OUT/$name.log")
  local detail="$passed passed, $failed failed, $skipped skipped (limit ${limit}s)"
  if (( rc == 124 || rc == 137 )); then
    record "$name" FAILED "timed out: $detail"
  elif (( rc != 0 || failed > 0 )); then
    record "$name" FAILED "exit $rc: $detail"
  elif (( skipped > 0 || passed == 0 )); then
    record "$name" FAILED "skipped on a GPU machine: $detail"
  else
    record "$name" ok "$detail"
  fi
}

run_gtest kernels_cuda_ops_test 75
run_gtest client_cuda_driver_abi_test 15

MPS_DIR=""
if command -v nvidia-cuda-mps-control >/dev/null; then
  MPS_DIR=$(mktemp -d)
  export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d >>"$OUT/preflight.log" 2>&1 || MPS_DIR=""
fi
run_gtest transport_nccl_test 120
if [[ -n "$MPS_DIR" ]]; then
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
run_gtest integration_daemon_cuda_test 90

# --- Python: CUDA tensors through the binding and the DDP hook ---------------
limit=$(budget 60)
if [[ -z "$PYTHON" ]] || ! "$PYTHON" -c "import torch, numpy, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  record python_torch_cuda FAILED "no python3 with CUDA-enabled torch and numpy"
elif (( limit < 5 )); then
  record python_torch_cuda "NOT RUN" "no time left"
else
  PYTHONPATH="$BUNDLE/source/client/python:$BUNDLE/source/pylib${PYTHONPATH:+:$PYTHONPATH}" \
    timeout --kill-after=5 "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
    "$BUNDLE/source/tests/python/test_torch_cuda.py" >"$OUT/python_torch_cuda.log" 2>&1
  rc=$?
  line=$(grep -E "passed|failed|error|skipped" "$OUT/python_torch_cuda.log" | tail -1)
  if (( rc != 0 )); then
    record python_torch_cuda FAILED "exit $rc: $line"
  elif grep -q "skipped" "$OUT/python_torch_cuda.log"; then
    record python_torch_cuda FAILED "skipped on a GPU machine: $line"
  else
    record python_torch_cuda ok "$line (torch $("$PYTHON" -c 'import torch; print(torch.__version__)'))"
  fi
fi

# --- The kernel benchmark beside the floor and torch.topk --------------------
SIZES=25557032,1000000000
limit=$(budget 80)
if (( limit < 10 )); then
  record bench_kernels_cuda "NOT RUN" "no time left"
else
  timeout --kill-after=5 $(( limit * 2 / 3 )) "$BUNDLE/bench/microd-bench-kernels-cuda" \
    --sizes="$SIZES" --reps=20 --json="$OUT/bench_kernels_cuda.json" >"$OUT/bench_kernels_cuda.log" 2>&1
  rc=$?
  if [[ -n "$PYTHON" ]]; then
    timeout --kill-after=5 $(( limit / 3 )) "$PYTHON" - "$SIZES" "$OUT/torch_topk.json" \
      >"$OUT/torch_topk.log" 2>&1 <<'EOF'
import json, sys, torch
sizes = [int(s) for s in sys.argv[1].split(",") if s]
out = []
print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
for d in sizes:
    x = torch.randn(d, device="cuda")
    for name, rho in (("1%", 0.01), ("0.1%", 0.001)):
        k = max(1, int(rho * d))
        ms = []
        for r in range(8):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.topk(x.abs(), k, sorted=False)
            b.record()
            torch.cuda.synchronize()
            if r >= 2:
                ms.append(a.elapsed_time(b))
        ms.sort()
        print(f"d = {d} density {name} k = {k}: torch.topk(x.abs(), k) {ms[len(ms) // 2]:.3f} ms")
        out.append({"d": d, "density": name, "ms": ms[len(ms) // 2]})
    del x
    torch.cuda.empty_cache()
json.dump(out, open(sys.argv[2], "w"))
EOF
  fi
  if (( rc != 0 )) || [[ ! -s "$OUT/bench_kernels_cuda.json" ]]; then
    record bench_kernels_cuda FAILED "exit $rc (see bench_kernels_cuda.log)"
  else
    table=$("${PYTHON:-python3}" - "$OUT/bench_kernels_cuda.json" "$OUT/torch_topk.json" <<'EOF' 2>&1
import json, os, sys
bench = json.load(open(sys.argv[1]))["rows"]
torch_rows = json.load(open(sys.argv[2])) if os.path.exists(sys.argv[2]) else []
torch_ms = {(r["d"], r["density"]): r["ms"] for r in torch_rows}
floor = {r["d"]: r["ms"] for r in bench if r["pass"].startswith("e += g")}
for r in bench:
    if not r["pass"].startswith("fused pass (acc"):
        continue
    ratio = r["ms"] / floor[r["d"]]
    t = torch_ms.get((r["d"], r["density"]))
    print(f"d={r['d']} {r['density']}: fused {r['ms']:.3f} ms = {ratio:.2f}x the e += g floor "
          f"(target <= 1.2x: {'met' if ratio <= 1.2 else 'MISSED'})"
          + (f"; torch.topk {t:.3f} ms, {t / r['ms']:.1f}x (target >= 20x: "
             f"{'met' if t / r['ms'] >= 20 else 'MISSED'})" if t else "; torch.topk not measured"))
EOF
)
    echo "$table" >"$OUT/bench_summary.txt"
    record bench_kernels_cuda ok "$(echo "$table" | tr '\n' ' ' | cut -c1-600)"
  fi
fi

# --- The device-resident step: CUDA kernels over NCCL, 2 ranks ---------------
limit=$(budget 45)
if (( limit < 10 )); then
  record bench_step_nccl "NOT RUN" "no time left"
else
  timeout --kill-after=5 "$limit" "$BUNDLE/bench/microd-bench-transport" --device=cuda --nodes=2 \
    --size=25557032 --warmup=3 --reps=10 --dense_reps=5 --json="$OUT/bench_step_nccl.json" \
    >"$OUT/bench_step_nccl.log" 2>&1
  rc=$?
  if (( rc != 0 )) || [[ ! -s "$OUT/bench_step_nccl.json" ]]; then
    record bench_step_nccl FAILED "exit $rc (see bench_step_nccl.log)"
  else
    line=$("${PYTHON:-python3}" - "$OUT/bench_step_nccl.json" <<'EOF' 2>&1
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
dense = rows[-1]
for r in rows:
    if r["method"].startswith("micro") and abs(r["density"] - 0.001) < 1e-9:
        print(f"micro 0.1%: {r['ms_per_step']:.2f} ms/step, {r['host_waits_per_step']} host "
              f"waits/step; {dense['method']} {dense['ms_per_step']:.2f} ms "
              f"({r['speedup_vs_dense_ring']:.1f}x)")
EOF
)
    record bench_step_nccl ok "$line"
  fi
fi

if (( FAILED )); then
  write_summary "done: FAILED"
  cat "$SUMMARY"
  exit 1
fi
write_summary "done: every phase passed"
cat "$SUMMARY"
