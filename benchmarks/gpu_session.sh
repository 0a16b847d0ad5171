#!/bin/bash
# One H200 call of a session's checks, in priority order, each under its own limit (logs in $OUT):
# the GPU suite, the xla path on W1, the bottom-right backward, sinks, FA3 against cuDNN, the CP simulation.
#   bash benchmarks/gpu_session.sh        (carry .whl/fe .whl/fa3 .prebuilt when the extension is prebuilt)
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/gpu_session}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $(find .whl -type f -name "*.whl") || exit 1
export PYTHONPATH=/tmp/site
if ls .prebuilt/_ext*.so >/dev/null 2>&1; then cp .prebuilt/_ext*.so jax_ragged_attn/; else STEPS=" " bash benchmarks/gpu_run.sh; fi
run() {  # run NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2; local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local status=$?
  echo "=== $name: exit $status after $(( $(date +%s) - t0 )) s"
}
run pytest "${PYTEST_S:-220}" python3 -m pytest -q -rs -p no:cacheprovider -n 8 -m "gpu and not soak" tests/ \
  --ignore=tests/test_load.py
grep -E "passed|failed" "$out/pytest.log" | tail -1; grep -E "^FAILED|^ERROR" "$out/pytest.log" | cut -c1-250 | head -20
run xla_w1 60 python3 -m benchmarks.xla_path --shape W1 --dtype bfloat16; tail -8 "$out/xla_w1.log"
run bottom_right 50 python3 -m benchmarks.bottom_right; tail -7 "$out/bottom_right.log"
run sinks 40 python3 -m benchmarks.sinks W1; tail -5 "$out/sinks.log"
run fa3 80 python3 -m benchmarks.fa3_compare --no-probe --workloads W1,W2
grep -vE "Warning|warn|^\s*$" "$out/fa3.log" | tail -12
run cpsim "${CPSIM_S:-100}" python3 -m benchmarks.context_parallel --implementation cudnn \
  --simulate 2,4,8 --workloads "${CPSIM_W:-CP-c}" --calls 3 --repetitions 3
grep "^| CP" "$out/cpsim.log"
