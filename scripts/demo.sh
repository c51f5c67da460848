#!/usr/bin/env bash
# The main job until the daemon lands: MiCRO on 4 simulated nodes with
# synthetic training-like gradients, the published threshold controller
# against ours, at 1 % and 0.1 % density. JSON under results/.
set -euo pipefail
BUILD=${1:-build}
SIM="$BUILD/daemon/sim/microd-sim"
mkdir -p results
for density in 0.01 0.001; do
  echo
  echo "### MiCRO, 4 nodes, d = 1,000,000, density $density: controller 'hist' (ours) vs 'paper'"
  "$SIM" --nodes=4 --size=1000000 --density="$density" --steps=600 --every=50 \
    --controller=hist,paper --json="results/sim-density-$density.json"
done
echo
echo "Per-step JSON: results/sim-density-*.json"
