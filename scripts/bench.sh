#!/usr/bin/env bash
# `make bench`: the kernel, transport and daemon benchmarks, the training-step
# comparison against PyTorch DDP (Gloo allreduce, fp16 and PowerSGD hooks),
# then one report (report.md, report.json, PNG charts) in the output folder.
#   scripts/bench.sh BUILD [--out DIR] [--smoke] [--skip-training]
# --smoke runs everything at tiny sizes for a few steps: it checks that the
# pipeline works (make test runs it), its figures mean nothing.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
shift || true
OUT=$ROOT/results/bench SMOKE=0 TRAINING=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --smoke) SMOKE=1; shift ;;
    --skip-training) TRAINING=0; shift ;;
    *) echo "bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
B=$BUILD/bench
if [[ $SMOKE == 1 ]]; then
  KERNELS=(--size=100000 --reps=1 --topk_reps=1)
  TRANSPORT=(--size=100000 --warmup=1 --reps=1 --dense_reps=1)
  DAEMON=(--size=100000 --warmup=1 --reps=1 --latency_iters=20)
  TRAIN=(--smoke)
else
  KERNELS=() TRANSPORT=() DAEMON=() TRAIN=()
fi
echo "== kernels"
"$B/microd-bench-kernels" "${KERNELS[@]}" --json="$OUT/kernels.json"
echo "== transport (raw MiCRO step over Gloo)"
"$B/microd-bench-transport" "${TRANSPORT[@]}" --json="$OUT/transport.json"
echo "== through the daemons"
"$B/microd-bench-daemon" "${DAEMON[@]}" --json="$OUT/daemon.json"
if [[ $TRAINING == 1 ]]; then
  echo "== training step: microd beside PyTorch DDP"
  /usr/bin/python3 "$ROOT/bench/training/run.py" "${TRAIN[@]}" --build "$BUILD" \
    --out "$OUT/training.json"
fi
echo "== report"
/usr/bin/python3 "$ROOT/bench/report.py" --dir "$OUT"
