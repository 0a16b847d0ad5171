#!/bin/bash
# Everything the offline H200 host (../shared/gpu-host/README.md) has to show, in one call from the repo root:
# the extension (prebuilt in .prebuilt/ when carried, else built here), the GPU tests, the benchmark, the
# demo and a GPU sweep tier, each under its own time limit, in that order of priority. Logs go to $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/jax_ragged_attn_gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site
start=$(date +%s)
if ls .prebuilt/_ext*.so >/dev/null 2>&1; then
  cp .prebuilt/_ext*.so jax_ragged_attn/  # built for this host's Python 3.12 and jaxlib 0.11.2
else
  # That host's default CXX (/opt/gcc/bin/g++, a wrapper) builds an extension that crashes inside
  # cudnn-frontend's string streams; the system compiler matches the libstdc++ the interpreter loads.
  CXX=/usr/bin/g++ python3 -m pip install --no-build-isolation --no-deps -e . -q 2>&1 | grep -E "error|Error"
fi
echo "extension ready: $(( $(date +%s) - start )) s"
failed=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log to $out/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) status
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  status=$?
  [ "$status" -eq 0 ] || failed+=("$name")
  echo "=== $name: exit $status after $(( $(date +%s) - t0 )) s"; tail -n "${TAIL:-25}" "$out/$name.log"
}
step pytest "${PYTEST_S:-90}" python3 -m pytest -q -rs -p no:cacheprovider tests/test_cudnn.py tests/test_extension.py tests/test_load.py
step bench "${BENCH_S:-150}" python3 -m jax_ragged_attn.bench ${BENCH_ARGS:---workloads W1,W2 --time-budget 100} --out "$out"
step demo "${DEMO_S:-45}" python3 -m jax_ragged_attn --plot "$out/demo_loss.png"
step sweep "${SWEEP_S:-40}" python3 -m jax_ragged_attn.sweep --tier gpu --num-tests "${SWEEP_N:-8}" --seed 0
[ ${#failed[@]} -eq 0 ] || { echo "failed steps: ${failed[*]}"; exit 1; }
