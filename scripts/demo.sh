#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job: a local cluster (4 nodes x 1 process by default) trains a
# small CNN on Fashion-MNIST through microd, with MiCRO at 1 % density and
# then with dense averaging, and reports them side by side (results/).
#   scripts/demo.sh BUILD [--nodes N] [--local L] [--density D] [--sparsifier S]
#                         [--controller C] [--epochs E] [--momentum-correction B]
#                         [--warmup-steps N]
# The sparse run uses momentum correction B (default 0.9, DGC): the daemon
# accumulates the velocity and the optimizer runs without momentum. B = 0
# applies SGD momentum 0.9 after the reduce instead.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
shift || true
NODES=4 LOCAL=1 DENSITY=0.01 SPARSIFIER=micro CONTROLLER=hist EPOCHS=2 MOMENTUM=0.9 WARMUP=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --local) LOCAL=$2; shift 2 ;;
    --density) DENSITY=$2; shift 2 ;;
    --sparsifier) SPARSIFIER=$2; shift 2 ;;
    --controller) CONTROLLER=$2; shift 2 ;;
    --epochs) EPOCHS=$2; shift 2 ;;
    --momentum-correction) MOMENTUM=$2; shift 2 ;;
    --warmup-steps) WARMUP=$2; shift 2 ;;
    *) echo "demo.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
cd "$ROOT"
mkdir -p results
export PYTHONPATH="$ROOT/client/python" MICROD_LIBRARY="$BUILD/client/libmicrod.so"
export MICROCTL="$BUILD/daemon/microctl" OMP_NUM_THREADS=1
TRAIN=(/usr/bin/python3 "$ROOT/examples/fashion_mnist/train.py" --epochs "$EPOCHS")
launch() {  # launch LABEL DAEMON-ARGS...
  local label=$1; shift
  local args=()
  for a in "$@"; do args+=(--daemon-arg "$a"); done
  "$ROOT/deploy/local/launch.sh" --nodes "$NODES" --local "$LOCAL" --microd "$BUILD/daemon/microd" \
    --show-first "${args[@]}" -- "${TRAIN[@]}" --label "$label" --out "results/$label.json"
}
echo "== $NODES nodes x $LOCAL process(es): $SPARSIFIER ($CONTROLLER) at density $DENSITY," \
  "momentum correction $MOMENTUM, $EPOCHS epoch(s)"
launch "$SPARSIFIER" "--sparsifier=$SPARSIFIER" "--controller=$CONTROLLER" "--density=$DENSITY" \
  "--momentum_correction=$MOMENTUM" "--warmup_steps=$WARMUP"
echo "== the same with dense averaging"
launch dense --sparsifier=dense
echo
/usr/bin/python3 "$ROOT/examples/fashion_mnist/report.py" "results/$SPARSIFIER.json" \
  results/dense.json --out results
