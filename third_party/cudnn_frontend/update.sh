#!/usr/bin/env bash
# Re-vendors cudnn-frontend's C++ headers from NVIDIA's nvidia-cudnn-frontend wheel (the include/ tree, byte
# for byte, with its license files) and records the wheel's name and sha256 in VERSION.
#
#   bash third_party/cudnn_frontend/update.sh 1.32.0
#
# The wheel is taken with --no-deps: we read its headers only (its Python package needs the CUTLASS DSL).
set -euo pipefail
version=${1:?usage: update.sh VERSION (e.g. 1.32.0)}
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: -d "$work/wheel" "nvidia-cudnn-frontend==$version"
wheel=$(ls "$work"/wheel/*.whl)
python3 -m zipfile -e "$wheel" "$work/unpacked"
rm -rf "$here/include"
cp -r "$work/unpacked/include" "$here/include"
cp "$work"/unpacked/nvidia_cudnn_frontend-"$version".dist-info/licenses/{LICENSE.txt,LICENSE-MIT.txt,NOTICE} "$here/"
{
  echo "$version"
  echo "from $(basename "$wheel")"
  echo "sha256 $(sha256sum "$wheel" | cut -d' ' -f1)"
} > "$here/VERSION"
grep -h -E 'define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION' "$here/include/cudnn_frontend_version.h"
