#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Every tracked C, C++ and CUDA file as the checked-in .clang-format has it
# (Debian's clang-format). --fix rewrites the files instead of failing.
#   scripts/check-format.sh [--fix]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "check-format: clang-format is missing (scripts/install-deps.sh)" >&2; exit 2; }
mapfile -t files < <(git ls-files -- '*.c' '*.cc' '*.h' '*.cu' '*.cuh')
if [[ "${1:-}" == "--fix" ]]; then
  clang-format --style=file -i "${files[@]}"
  echo "check-format: formatted ${#files[@]} files"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  clang-format --style=file "$f" | cmp -s - "$f" || bad+=("$f")
done
if [[ ${#bad[@]} -gt 0 ]]; then
  echo "check-format: ${#bad[@]} of ${#files[@]} files differ from .clang-format" \
    "(make format rewrites them):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
