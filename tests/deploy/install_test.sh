#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the build tree into a temporary prefix with scripts/build-install.sh
# (the Dockerfile's build step) and checks what users of an installation rely
# on: the files are there; client/examples/allreduce_example.c builds out of
# tree with find_package(microd) (shared and static) and with pkg-config; the
# Python package pip-installs and finds libmicrod in the prefix and next to
# itself; and all of them, the installed microd, microd-health and microctl
# run a 2-node job (deploy/local/launch.sh) averaging the right values.
#
#   tests/deploy/install_test.sh BUILD_DIR
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=$(cd "${1:?usage: install_test.sh BUILD_DIR}" && pwd)
PYTHON=/usr/bin/python3
T=$(mktemp -d "${TMPDIR:-/tmp}/microd-install-XXXXXX")
trap 'rm -rf "$T"' EXIT
P=$T/usr
fail() { echo "FAIL: $*" >&2; exit 1; }
step() { echo "--- $*"; }
loaded_from() {  # the libmicrod.so.0 a program loads, as a real path ("" if none)
  local path
  path=$(ldd "$1" | awk '$1 == "libmicrod.so.0" { print $3 }')
  if [[ -n "$path" ]]; then realpath "$path"; fi
}

step "install into $P"
"$ROOT/scripts/build-install.sh" --build-dir "$BUILD" --prefix "$P" --jobs 1 \
  --runtime-packages "$T/runtime-packages.txt"
LIBDIR=$(dirname "$(find "$P" -name libmicrod.so -print -quit)")
[[ -n "$LIBDIR" && "$LIBDIR" != . ]] || fail "no libmicrod.so in $P"
for f in bin/microd bin/microctl bin/microd-health include/microd/microd.h \
         libexec/microd/microd-example; do
  [[ -f "$P/$f" ]] || fail "$f not installed"
done
for f in libmicrod.so libmicrod.a pkgconfig/microd.pc cmake/microd/microdConfig.cmake \
         cmake/microd/microdConfigVersion.cmake cmake/microd/microdTargets.cmake; do
  [[ -e "$LIBDIR/$f" ]] || fail "$f not installed in $LIBDIR"
done
for x in microd microctl microd-health; do [[ -x "$P/bin/$x" ]] || fail "$x not executable"; done
# The shared library exports only the API and carries its SONAME.
grep -q 'SONAME *libmicrod.so.0' <<< "$(objdump -p "$LIBDIR/libmicrod.so")" || fail "SONAME"
if nm -D --defined-only "$LIBDIR/libmicrod.so" | awk '$2 == "T" { print $3 }' | grep -v '^microd_'; then
  fail "libmicrod.so exports symbols outside microd_*"
fi
# Installed programs must not load anything from the build tree (no grep -q
# after a pipe in this script: with pipefail, an early exit fails the pipe).
for x in "$P"/bin/*; do
  if ldd "$x" | grep -F "$BUILD"; then fail "$x loads from the build tree"; fi
done
grep -qx 'libgrpc++1.51\|libgrpc++[0-9.]*' "$T/runtime-packages.txt" ||
  fail "runtime package list lacks gRPC: $(cat "$T/runtime-packages.txt")"

step "CMake consumer (find_package(microd), out of tree)"
mkdir -p "$T/cmake-consumer"
cat > "$T/cmake-consumer/CMakeLists.txt" <<EOF
cmake_minimum_required(VERSION 3.22)
project(consumer C)
find_package(microd 0.1 REQUIRED)
add_executable(example_shared "$ROOT/client/examples/allreduce_example.c")
target_link_libraries(example_shared PRIVATE microd::client)
add_executable(example_static "$ROOT/client/examples/allreduce_example.c")
target_link_libraries(example_static PRIVATE microd::client_static)
EOF
cmake -S "$T/cmake-consumer" -B "$T/cmake-consumer/build" -DCMAKE_PREFIX_PATH="$P" \
  -DCMAKE_BUILD_TYPE=Release > "$T/cmake-consumer.log" 2>&1 ||
  { cat "$T/cmake-consumer.log"; fail "configuring the consumer"; }
cmake --build "$T/cmake-consumer/build" >> "$T/cmake-consumer.log" 2>&1 ||
  { cat "$T/cmake-consumer.log"; fail "building the consumer"; }
EX_SHARED=$T/cmake-consumer/build/example_shared
EX_STATIC=$T/cmake-consumer/build/example_static
[[ $(loaded_from "$EX_SHARED") == "$(realpath "$LIBDIR/libmicrod.so.0")" ]] || fail "example_shared does not load the installed library"
if [[ -n $(loaded_from "$EX_STATIC") ]]; then fail "example_static loads libmicrod.so"; fi
# A version the package must refuse.
cat > "$T/cmake-consumer/too-new.cmake" <<'EOF'
find_package(microd 99 QUIET)
if(microd_FOUND)
  message(FATAL_ERROR "find_package(microd 99) accepted version ${microd_VERSION}")
endif()
EOF
cmake -DCMAKE_PREFIX_PATH="$P" -P "$T/cmake-consumer/too-new.cmake" || fail "version check"

step "pkg-config consumer"
export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
[[ $(pkg-config --modversion microd) == "$(sed -n 's/^project(microd VERSION \([0-9.]*\).*/\1/p' "$ROOT/CMakeLists.txt")" ]] ||
  fail "pkg-config --modversion microd: $(pkg-config --modversion microd)"
# shellcheck disable=SC2046
cc -std=c99 -Wall -Werror $(pkg-config --cflags microd) "$ROOT/client/examples/allreduce_example.c" \
  -o "$T/example_pc" $(pkg-config --libs microd) -Wl,-rpath,"$(pkg-config --variable=libdir microd)"
[[ $(loaded_from "$T/example_pc") == "$(realpath "$LIBDIR/libmicrod.so.0")" ]] ||
  fail "example_pc does not load the installed library: $(ldd "$T/example_pc")"
# shellcheck disable=SC2046
cc -std=c99 -static-libgcc $(pkg-config --cflags microd) "$ROOT/client/examples/allreduce_example.c" \
  -o "$T/example_pc_static" "$LIBDIR/libmicrod.a" $(pkg-config --static --libs-only-other microd)
unset PKG_CONFIG_PATH

step "Python package (pip install from the repository)"
cp -r "$ROOT/client/python" "$T/python-src"  # pip builds in place: keep the repo clean
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index --prefix "$P" \
  "$T/python-src" 2>&1 | grep -v 'as the .root. user' || true
SITE=$(dirname "$(dirname "$(find "$P" -path '*-packages/microd/__init__.py' -print -quit)")")
[[ -d "$SITE" && "$SITE" != . ]] || fail "pip did not install microd under $P"
found=$(cd "$T" && env -u MICROD_LIBRARY -u MICROD_PREFIX PYTHONPATH="$SITE" "$PYTHON" -c \
  'import microd; print(microd.library_path())')
[[ "$found" == "$LIBDIR/libmicrod.so" ]] || fail "microd.library_path() is $found, not in the prefix"
# "Next to it": the package folder holding its own copy of the library.
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index --target "$T/bundled" \
  "$T/python-src" 2>&1 | grep -v 'as the .root. user' || true
cp "$LIBDIR/libmicrod.so.0" "$T/bundled/microd/libmicrod.so"
found=$(cd "$T" && env -u MICROD_LIBRARY -u MICROD_PREFIX PYTHONPATH="$T/bundled" "$PYTHON" -c \
  'import microd; print(microd.library_path())')
[[ "$found" == "$T/bundled/microd/libmicrod.so" ]] || fail "bundled library not found: $found"

step "a 2-node job with the installed programs"
cat > "$T/program.sh" <<EOF
#!/usr/bin/env bash
# One training process: every client build, the Python binding, then the
# installed health check and microctl against this node's daemon.
set -euo pipefail
for ex in "$EX_SHARED" "$EX_STATIC" "$T/example_pc" "$T/example_pc_static" "$P/libexec/microd/microd-example"; do
  "\$ex"
done
cd "$T"
env -u MICROD_LIBRARY PYTHONPATH="$SITE" "$PYTHON" -c '
import microd
with microd.Client() as c:
    b = c.register("py", 1000)
    b.array[:] = c.job.rank + 1
    c.allreduce(b)
    print("python rank", c.job.rank, "of", c.job.world_size, "update", float(b.array[0]))
'
"$P/bin/microd-health"
"$P/bin/microd-health" --service=microd
"$P/bin/microctl" status
EOF
chmod +x "$T/program.sh"
"$ROOT/deploy/local/launch.sh" --nodes 2 --local 1 --microd "$P/bin/microd" --logs "$T/logs" \
  -- "$T/program.sh" || { tail -n 20 "$T"/logs/*; fail "the job failed"; }
for r in 0 1; do
  log=$T/logs/program-node$r-local0.log
  n=$(grep -c "rank $r of 2: first value of the averaged update 1.5$" "$log" || true)
  [[ $n -eq 5 ]] || { cat "$log"; fail "node $r: $n of 5 example builds averaged to 1.5"; }
  grep -q "python rank $r of 2 update 1.5$" "$log" || { cat "$log"; fail "node $r: python"; }
  [[ $(grep -c ": SERVING$" "$log") -eq 2 ]] || { cat "$log"; fail "node $r: microd-health"; }
  grep -q "^job *running" "$log" || { cat "$log"; fail "node $r: microctl status"; }
done

step "health of a daemon still waiting for the other node"
"$P/bin/microd" --socket="$T/alone/microd.sock" --nodes=2 --coordinator_listen=127.0.0.1:0 \
  --admin=127.0.0.1:0 --admin_port_file="$T/alone.port" > "$T/alone.log" 2>&1 &
ALONE=$!
for _ in $(seq 100); do [[ -s "$T/alone.port" ]] && break; sleep 0.1; done
[[ -s "$T/alone.port" ]] || { kill "$ALONE"; cat "$T/alone.log"; fail "lone daemon did not start"; }
code_all=0; code_joined=0
"$P/bin/microd-health" --admin="127.0.0.1:$(cat "$T/alone.port")" || code_all=$?
"$P/bin/microd-health" --admin="127.0.0.1:$(cat "$T/alone.port")" --service=microd || code_joined=$?
# SIGKILL: microd reads SIGTERM only after it joined (it would wait out the join).
kill -KILL "$ALONE"; wait "$ALONE" || true
[[ $code_all -eq 0 ]] || fail "microd-health of a starting daemon exited $code_all, not 0"
[[ $code_joined -eq 1 ]] || fail "microd-health --service=microd before the join exited $code_joined, not 1"

step "microd-health without a daemon"
code=0
"$P/bin/microd-health" --admin=127.0.0.1:1 --timeout_ms=2000 || code=$?
[[ $code -eq 2 ]] || fail "microd-health against a closed port exited $code, not 2"
echo "install test: all checks passed"
