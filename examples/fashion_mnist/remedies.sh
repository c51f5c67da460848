#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue H's table: final test accuracy on Fashion-MNIST after the same epochs
# for dense and for MiCRO at 1 % and 0.1 % with each remedy alone and all
# together (4 nodes x 1 process, the demo's CNN, SGD lr 0.05; momentum 0.9
# either after the reduce or, with momentum correction, in the daemons).
#   examples/fashion_mnist/remedies.sh BUILD [--epochs E] [--out DIR] [--only LABEL,...]
# Writes DIR/<label>.json per run and DIR/remedies.md (the table).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:-$ROOT/build}" && pwd)
shift || true
EPOCHS=2 OUT=$ROOT/results/remedies ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --epochs) EPOCHS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    *) echo "remedies.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/client/python" MICROD_LIBRARY="$BUILD/client/libmicrod.so"
export MICROCTL="$BUILD/daemon/microctl" OMP_NUM_THREADS=1
MC=--momentum_correction=0.9
NOMC=--momentum_correction=0
# label | density | daemon flags (the warm-up decays to the target over 400
# steps after 50 dense ones; clipping at global norm 1.0 per bucket)
RUNS=(
  "dense|1|--sparsifier=dense $NOMC"
  "1%-none|0.01|$NOMC"
  "1%-momentum-correction|0.01|$MC"
  "1%-warm-up|0.01|$NOMC --warmup_steps=50 --warmup_density=0.25 --warmup_decay_steps=400"
  "1%-clipping|0.01|$NOMC --clip_norm=1.0"
  "1%-all|0.01|$MC --warmup_steps=50 --warmup_density=0.25 --warmup_decay_steps=400 --clip_norm=1.0"
  "0.1%-none|0.001|$NOMC"
  "0.1%-momentum-correction|0.001|$MC"
  "0.1%-warm-up|0.001|$NOMC --warmup_steps=50 --warmup_density=0.1 --warmup_decay_steps=400"
  "0.1%-clipping|0.001|$NOMC --clip_norm=1.0"
  "0.1%-all|0.001|$MC --warmup_steps=50 --warmup_density=0.1 --warmup_decay_steps=400 --clip_norm=1.0"
)
for run in "${RUNS[@]}"; do
  IFS='|' read -r label density flags <<<"$run"
  [[ -z "$ONLY" || ",$ONLY," == *",$label,"* ]] || continue
  args=()
  for f in --sparsifier=micro "--density=$density" $flags; do args+=(--daemon-arg "$f"); done
  echo "== $label: density $density, $flags"
  if ! "$ROOT/deploy/local/launch.sh" --nodes 4 --local 1 --microd "$BUILD/daemon/microd" \
      --logs "$OUT/$label.logs" "${args[@]}" -- /usr/bin/python3 \
      "$ROOT/examples/fashion_mnist/train.py" --epochs "$EPOCHS" --label "$label" \
      --out "$OUT/$label.json" 2>&1 | tail -n 3; then
    echo "   $label failed (logs: $OUT/$label.logs)"
  fi
  if [[ ! -f "$OUT/$label.json" ]]; then
    grep -h "NaN\|Inf\|FAILED\|Error" "$OUT/$label.logs"/* 2>/dev/null | head -n 2 \
      > "$OUT/$label.failed" || true
  fi
done
/usr/bin/python3 - "$OUT" "$EPOCHS" <<'PY'
import json, os, re, sys
out, epochs = sys.argv[1], sys.argv[2]
rows = []
for f in sorted(os.listdir(out)):
    label, ext = os.path.splitext(f)
    if ext == ".json":
        r = json.load(open(os.path.join(out, f)))
        rows.append((label, f"{100 * r['final_accuracy']:.2f} %", f"{r['final_test_loss']:.4f}"))
    elif ext == ".failed":
        why = open(os.path.join(out, f)).read()
        m = re.search(r"step (\d+): NaN or Inf", why)
        rows.append((label, "diverged", f"NaN/Inf in the gradients at step {m.group(1)}, "
                     "reported on every node" if m else "failed: see the logs"))
order = ["dense", "1%-none", "1%-momentum-correction", "1%-warm-up", "1%-clipping", "1%-all",
         "0.1%-none", "0.1%-momentum-correction", "0.1%-warm-up", "0.1%-clipping", "0.1%-all"]
rows.sort(key=lambda r: order.index(r[0]) if r[0] in order else len(order))
md = [f"Fashion-MNIST, 4 nodes, {epochs} epoch(s)", "", "| run | test accuracy | test loss / error |",
      "|---|---:|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
open(os.path.join(out, "remedies.md"), "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
