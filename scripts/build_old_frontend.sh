#!/bin/bash
# Builds the extension against cudnn-frontend 1.27 - the last release with the head-major zero-gradient bug -
# into .prebuilt127/, for tests/test_known_issues.py::test_reproduces_cudnn_frontend_462. Test use only: the
# build needs -DJAX_RAGGED_ATTN_ALLOW_OLD_FRONTEND=ON, and the op then relies on its run-time full-extent check.
#
#   PYTHON=/path/to/python3.12 bash scripts/build_old_frontend.sh   # the GPU host's Python and jax version
set -euo pipefail
python=${PYTHON:-python3}
work=$(mktemp -d)
"$python" -m pip download -q --no-deps "nvidia-cudnn-frontend==1.27.0" -d "$work/wheel"
"$python" -m pip install -q --no-deps --target "$work/site" "$work"/wheel/*.whl
# importlib.metadata takes the first distribution on the path: PYTHONPATH puts 1.27 ahead of any installed one.
PYTHONPATH="$work/site" "$python" -m pip wheel -q --no-build-isolation --no-deps . -w "$work/out" \
  -C cmake.define.JAX_RAGGED_ATTN_ALLOW_OLD_FRONTEND=ON -C build-dir="$work/build"
mkdir -p .prebuilt127
unzip -o -j -q "$work"/out/*.whl 'jax_ragged_attn/_ext*.so' -d .prebuilt127/
echo "built against: $(grep -h -E 'define CUDNN_FRONTEND_(MAJOR|MINOR)_VERSION' "$work"/site/include/cudnn_frontend_version.h | awk '{print $3}' | paste -sd.)"
rm -rf "$work"
