#!/usr/bin/env bash
# Installs every Debian package microd needs to build, test and run its demo.
# Idempotent: packages already present are skipped; apt-get runs only when
# something is missing. Needs root (or sudo) when it has to install.
set -euo pipefail

PACKAGES=(
  build-essential cmake make pkg-config git
  libabsl-dev
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  libgloo-dev
  # Python side: the binding's tests, the PyTorch integration and the demo
  # (Debian's interpreter, /usr/bin/python3).
  python3 python3-numpy python3-torch python3-matplotlib python3-pytest
  dataset-fashion-mnist
)

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
