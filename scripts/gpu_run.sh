#!/bin/bash
# Build, test and self-check on the offline H200 host (../shared/gpu-host/README.md), from the repo root,
# with the cudnn-frontend wheel carried in .whl/. Logs go to $OUT when it is set.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/jax_ragged_attn_gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
# That host's default CXX (/opt/gcc/bin/g++, a wrapper) builds an extension that crashes inside
# cudnn-frontend's string streams; the system compiler matches the libstdc++ the interpreter loads.
export CXX=/usr/bin/g++
start=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | grep -E "error|Error" ; echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -rs -p no:cacheprovider ${@:-tests/test_cudnn.py tests/test_extension.py} 2>&1 \
  | tee "$out/pytest.log" | tail -40
python3 -m jax_ragged_attn 2>&1 | tee "$out/selfcheck.log"
