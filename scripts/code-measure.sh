#!/usr/bin/env bash
# The sizes issue L measures: lines per file of daemon/engine, the longest
# C/C++ functions of daemon/ and client/ (CUDA kernels excluded), README lines.
# Usage: scripts/code-measure.sh [how many functions, default 10]
set -euo pipefail
cd "$(dirname "$0")/.."
top=${1:-10}
echo "== lines per file, daemon/engine"
wc -l daemon/engine/*.h daemon/engine/*.cc | sort -rn
echo "== longest functions (lines), daemon/ and client/"
find daemon client -name '*.cc' -o -name '*.c' -o -name '*.h' | sort |
  xargs ctags --fields=+ne --kinds-c++=f --kinds-c=f -o - |
  awk -F'\t' '{ line = ""; end = ""; for (i = 4; i <= NF; i++) {
                  if ($i ~ /^line:/) line = substr($i, 6); if ($i ~ /^end:/) end = substr($i, 5) }
                if (line != "" && end != "") print end - line + 1, $1, $2 ":" line }' |
  sort -rn | head -n "$top"
echo "== README.md: $(wc -l < README.md) lines"
