#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds what `cmake --install` ships and installs it into a prefix: microd,
# microctl, microd-health, libmicrod.so/.a, the header, the CMake package and
# microd.pc. The Dockerfile's build stage and the install test
# (tests/deploy/install_test.sh) both run this script, so what the image gets
# is what the test checks.
#
#   scripts/build-install.sh --prefix DIR [--build-dir DIR] [--jobs N]
#                            [--runtime-packages FILE] [--configure-only]
#                            [-- CMAKE_ARGS...]
#
# A build directory that is already configured is used as it is (the test
# passes the tree ctest runs in); otherwise it is configured for a release
# build without tests and benchmarks, with CMAKE_ARGS added.
# --configure-only stops after configuring (tests/deploy checks that the
# files the Dockerfile copies are enough for CMake).
# --runtime-packages FILE writes the Debian packages that hold the shared
# libraries the installed programs load (the runtime image installs them).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=$ROOT/build-release
PREFIX=""
JOBS=$(nproc)
RUNTIME_PACKAGES=""
CONFIGURE_ONLY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --build-dir) BUILD=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --runtime-packages) RUNTIME_PACKAGES=$2; shift 2 ;;
    --configure-only) CONFIGURE_ONLY=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "build-install: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$PREFIX" ]] || { echo "build-install: --prefix DIR is required" >&2; exit 2; }

# The targets the install rules name (client/, daemon/ and cmake/MicrodInstall.cmake).
TARGETS=(microd microctl microd-health microd_client_shared microd_client_static microd-example)

if [[ -f "$BUILD/CMakeCache.txt" ]]; then
  echo "build-install: using the configured build directory $BUILD"
else
  cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMICROD_BUILD_TESTS=OFF \
    -DMICROD_BUILD_BENCH=OFF "$@"
fi
if [[ $CONFIGURE_ONLY -eq 1 ]]; then echo "build-install: configured $BUILD"; exit 0; fi
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}"
cmake --install "$BUILD" --prefix "$PREFIX"

if [[ -n "$RUNTIME_PACKAGES" ]]; then
  # Every shared library the installed programs load, mapped to its package.
  libs=$(for f in "$PREFIX"/bin/* "$PREFIX"/lib*/libmicrod.so "$PREFIX"/lib/*/libmicrod.so; do
           if [[ -f "$f" ]]; then ldd "$f"; fi
         done | awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u)
  : > "$RUNTIME_PACKAGES"
  for lib in $libs; do
    real=$(readlink -f "$lib")
    case "$real" in "$(readlink -f "$PREFIX")"/*) continue ;; esac  # our own library
    case "$real" in
      */cuda*/lib*/*|*/cuda*/targets/*)  # the CUDA toolkit's: the CUDA runtime image has them
        echo "build-install: $lib comes with the CUDA toolkit (use a CUDA runtime image)" >&2
        continue ;;
    esac
    pkg=$( (dpkg -S "$lib" 2>/dev/null || dpkg -S "$real" 2>/dev/null || true) | head -n 1)
    if [[ -z "$pkg" ]]; then
      echo "build-install: no Debian package holds $lib" >&2; exit 1
    fi
    echo "${pkg%%:*}" >> "$RUNTIME_PACKAGES"  # "libfoo1:amd64: /path" -> "libfoo1"
  done
  sort -u -o "$RUNTIME_PACKAGES" "$RUNTIME_PACKAGES"
  echo "build-install: runtime packages in $RUNTIME_PACKAGES: $(tr '\n' ' ' < "$RUNTIME_PACKAGES")"
fi
echo "build-install: installed into $PREFIX"
