#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the GPU checks here (no GPU needed) and packs them into a bundle
# that runs on a GPU machine without this project's dependencies: CUDA for
# sm_90 (Release), the GPU test binaries and their helpers, microd, microctl,
# libmicrod.so, the CUDA kernel benchmark, the Python package and its CUDA
# tests, and every shared library they need that such a machine lacks
# (abseil, Protobuf, gRPC, Gloo, ...; not glibc, libstdc++, the CUDA driver or
# NCCL, which run.sh finds there: the toolkit's libnccl is 208 MiB). The
# bundle keeps the build tree's layout (tests find their helpers under
# MICROD_BUILD_DIR, tests/helper_path.h); every executable and library finds
# the others through RUNPATH $ORIGIN/..., nothing through a path of this
# machine. Then it checks itself (scripts/gpu-bundle-check.sh).
#
#   scripts/gpu-bundle.sh [--build-dir build-gpu] [--out build/gpu-bundle] [--arch 90]
#
# Run it there: the `device` tool carries build/gpu-bundle; `build/gpu-bundle/run.sh`.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD_DIR="$ROOT/build-gpu"
OUT="$ROOT/build/gpu-bundle"
ARCH=90
LIMIT_MIB=60
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) BUILD_DIR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --arch) ARCH="$2"; shift 2 ;;
    *) echo "usage: $0 [--build-dir DIR] [--out DIR] [--arch 90]" >&2; exit 2 ;;
  esac
done
bash "$ROOT/scripts/install-deps.sh" --gpu-bundle

NVCC="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
echo "gpu-bundle: configure $BUILD_DIR (sm_$ARCH, Release)"
mkdir -p "$BUILD_DIR"
cmake -S "$ROOT" -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$NVCC" -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
  -DMICROD_BUILD_BENCH=ON -DMICROD_BUILD_TESTS=ON \
  -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib;$ORIGIN/../client' \
  >"$BUILD_DIR/bundle-configure.log" 2>&1 || { tail -30 "$BUILD_DIR/bundle-configure.log"; exit 1; }
if ! grep -q "NCCL transport enabled" "$BUILD_DIR/bundle-configure.log"; then
  echo "gpu-bundle: CMake found no CUDA or no NCCL (see $BUILD_DIR/bundle-configure.log)" >&2
  exit 1
fi

# What the GPU checks run, as paths inside the build tree (= inside the bundle).
EXECUTABLES=(
  tests/kernels_cuda_ops_test tests/client_cuda_driver_abi_test
  tests/transport_nccl_test tests/microd-test-nccl-rank
  tests/integration_daemon_cuda_test tests/microd-test-cuda-client
  daemon/microd daemon/microctl daemon/microd-health
  bench/microd-bench-kernels-cuda bench/microd-bench-transport
)
LIBRARIES=(client/libmicrod.so)
TARGETS=()
for f in "${EXECUTABLES[@]}"; do TARGETS+=("$(basename "$f")"); done
TARGETS+=(microd_client_shared)
echo "gpu-bundle: build ${TARGETS[*]}"
cmake --build "$BUILD_DIR" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}" >"$BUILD_DIR/bundle-build.log" 2>&1 ||
  { grep -E "error|Error" "$BUILD_DIR/bundle-build.log" | head -40; exit 1; }

rm -rf "$OUT"
mkdir -p "$OUT/lib" "$OUT/source"
for f in "${EXECUTABLES[@]}" "${LIBRARIES[@]}"; do
  mkdir -p "$OUT/$(dirname "$f")"
  cp -L "$BUILD_DIR/$f" "$OUT/$f"
  strip --strip-unneeded "$OUT/$f"
done
# The SONAME link libmicrod.so.0 next to the library.
soname=$(objdump -p "$OUT/client/libmicrod.so" | awk '/SONAME/ {print $2}')
[[ -n "$soname" && "$soname" != libmicrod.so ]] && ln -sf libmicrod.so "$OUT/client/$soname"

# Shared libraries the machine lacks: everything ldd resolves except the C
# and C++ runtimes, the CUDA driver and NCCL. Copied under their SONAME,
# stripped, RUNPATH $ORIGIN (so they find each other).
is_system() {
  case "${1##*/}" in
    linux-vdso.so.*|ld-linux*|libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*) return 0 ;;
    libstdc++.so.*|libgcc_s.so.*|libcuda.so.*|libnvidia-*|libnccl.so.*) return 0 ;;
  esac
  return 1
}
queue=()
for f in "${EXECUTABLES[@]}" "${LIBRARIES[@]}"; do queue+=("$OUT/$f"); done
while [[ ${#queue[@]} -gt 0 ]]; do
  elf="${queue[0]}"
  queue=("${queue[@]:1}")
  while read -r name path; do
    [[ -z "$name" ]] && continue
    is_system "$name" && continue
    [[ -e "$OUT/lib/$name" || "$name" == libmicrod.so* ]] && continue
    if [[ "$path" == "not" || ! -e "$path" ]]; then
      echo "gpu-bundle: $(basename "$elf") needs $name, which is not on this machine either" >&2
      exit 1
    fi
    cp -L "$path" "$OUT/lib/$name"
    chmod u+w "$OUT/lib/$name"
    strip --strip-unneeded "$OUT/lib/$name"
    patchelf --set-rpath '$ORIGIN' "$OUT/lib/$name"
    queue+=("$OUT/lib/$name")
  done < <(LD_LIBRARY_PATH="$OUT/lib:$OUT/client" ldd "$elf" 2>/dev/null |
           awk '/=>/ {print $1, $3} !/=>/ && /\.so/ {print $1, ""}')
done
# The executables' RUNPATH as built ($ORIGIN/../lib:$ORIGIN/../client);
# libmicrod's own deps are libc only.

# The Python package and the tests that run there, and pytest (pure Python,
# Debian's) for the machine's interpreter.
mkdir -p "$OUT/source/client"
cp -r "$ROOT/client/python" "$OUT/source/client/python"
mkdir -p "$OUT/source/tests/python"
cp "$ROOT/tests/python/conftest.py" "$ROOT/tests/python/test_torch_cuda.py" \
  "$ROOT/tests/python/torch_worker.py" "$OUT/source/tests/python/"
mkdir -p "$OUT/source/pylib"
for m in pytest _pytest pluggy iniconfig py py.py attr attrs packaging more_itertools exceptiongroup tomli; do
  for d in /usr/lib/python3/dist-packages; do
    [[ -e "$d/$m" ]] && cp -r "$d/$m" "$OUT/source/pylib/"
  done
done
find "$OUT/source" -name __pycache__ -prune -exec rm -rf {} +
cp "$ROOT/scripts/gpu-run.sh" "$OUT/run.sh"
chmod +x "$OUT/run.sh"
git -C "$ROOT" rev-parse --short HEAD >"$OUT/REVISION" 2>/dev/null || echo unknown >"$OUT/REVISION"

size_kib=$(du -sk "$OUT" | cut -f1)
echo "gpu-bundle: $OUT: $((size_kib / 1024)) MiB ($size_kib KiB), limit $LIMIT_MIB MiB"
du -sk "$OUT"/* | sort -rn | head -8
if [[ $size_kib -gt $((LIMIT_MIB * 1024)) ]]; then
  echo "gpu-bundle: over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
bash "$ROOT/scripts/gpu-bundle-check.sh" "$OUT"
