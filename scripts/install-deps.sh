#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs every Debian package microd needs to build, test and run its demo.
# Idempotent: packages already present are skipped; apt-get runs only when
# something is missing. Needs root (or sudo) when it has to install.
#   scripts/install-deps.sh           everything (build, tests, demo)
#   scripts/install-deps.sh --build   only what building and installing microd
#                                     needs (the Dockerfile's build stage)
#   scripts/install-deps.sh --fuzz    everything and clang with libFuzzer (make fuzz)
#   scripts/install-deps.sh --coverage   everything and lcov (make coverage)
#   scripts/install-deps.sh --gpu-bundle   everything and patchelf (make gpu-bundle)
#   scripts/install-deps.sh --image   podman, buildah, debootstrap and runc, with
#                                     netavark and aardvark-dns for networks with
#                                     DNS, catatonit for pods (make image, make image-test)
set -euo pipefail

BUILD_PACKAGES=(
  build-essential cmake make pkg-config git
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  libgloo-dev
  prometheus-cpp-dev libssl-dev
)
TEST_PACKAGES=(
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  # Python side: the binding's tests, the PyTorch integration and the demo
  # (Debian's interpreter, /usr/bin/python3).
  python3 python3-numpy python3-torch python3-matplotlib python3-pytest
  dataset-fashion-mnist
  # Packaging tests: pip-installing client/python, linting the deployment files.
  python3-pip python3-setuptools python3-yaml yamllint
  # The emulated cluster (deploy/netlab): namespaces, veth, tc, iptables,
  # the delay and tamper helpers' NFQUEUE library, and tcpdump (the sealed
  # data plane's capture test).
  iproute2 iptables libnetfilter-queue-dev tcpdump
  # make format-check (the CI): the C/C++ formatter .clang-format is for.
  clang-format
)
# make fuzz only: clang with libFuzzer and the sanitizer runtimes.
FUZZ_PACKAGES=(clang libclang-rt-14-dev)
# make coverage only: lcov (gcov comes with the compiler).
COVERAGE_PACKAGES=(lcov)
# scripts/gpu-bundle.sh only: RUNPATHs of the bundled libraries.
BUNDLE_PACKAGES=(patchelf)
# make image / image-test only: containers from Debian's packages, no registry.
IMAGE_PACKAGES=(podman buildah debootstrap runc netavark aardvark-dns catatonit iptables iproute2)
case "${1:-}" in
  "") PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}") ;;
  --build) PACKAGES=("${BUILD_PACKAGES[@]}") ;;
  --fuzz) PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}" "${FUZZ_PACKAGES[@]}") ;;
  --coverage) PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}" "${COVERAGE_PACKAGES[@]}") ;;
  --gpu-bundle) PACKAGES=("${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}" "${BUNDLE_PACKAGES[@]}") ;;
  --image) PACKAGES=("${IMAGE_PACKAGES[@]}") ;;
  *) echo "install-deps: unknown option $1 (--build, --fuzz, --coverage, --gpu-bundle, --image or nothing)" >&2
     exit 2 ;;
esac

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install-deps: need root to install: ${missing[*]}" >&2; exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "install-deps: done"
