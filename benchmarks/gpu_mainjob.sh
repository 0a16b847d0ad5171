#!/bin/bash
# The main job on the H200 (issue 25): step breakdown, side-by-sides (GPU and long presets), held-out bits per
# byte, generation; then the xla path on W1 against jax.nn padded XLA (issue 27). Carry .whl/fe .whl/flax .prebuilt.
export PYTHONUNBUFFERED=1 JAX_COMPILATION_CACHE_DIR=/tmp/lm_jax_cache
out=${OUT:-/tmp/gpu_mainjob}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  $(find .whl -type f -name "*.whl") || exit 1
export PYTHONPATH=/tmp/site
if ls .prebuilt/_ext*.so >/dev/null 2>&1; then cp .prebuilt/_ext*.so jax_ragged_attn/; else STEPS=" " bash benchmarks/gpu_run.sh; fi
if [ -n "${RETEST:-}" ]; then
  timeout 60 python3 -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu $RETEST > "$out/retest.log" 2>&1
  echo "=== retest: exit $?"; grep -E "passed|failed|^FAILED|^E  " "$out/retest.log" | cut -c1-250 | tail -8
fi
timeout "${LM_S:-230}" python3 -m jax_ragged_attn --preset gpu --steps "${LM_STEPS:-1000}" --profile --no-progress --plot '' \
  > "$out/lm_gpu.log" 2>&1; echo "=== gpu preset: exit $?"; grep -vE "Warning|warn" "$out/lm_gpu.log" | tail -60
timeout "${LONG_S:-120}" python3 -m jax_ragged_attn --preset long --steps 150 --compare-steps 5 --sample-bytes 0 \
  --max-bits-per-byte 8 --no-progress --plot '' > "$out/lm_long.log" 2>&1
echo "=== long preset: exit $?"; grep -vE "Warning|warn" "$out/lm_long.log" | tail -30
timeout "${XLA_S:-120}" python3 -m benchmarks.xla_path --shape W1 --dtype bfloat16 --repeats 3 \
  --target 0.3 > "$out/xla_w1.log" 2>&1; echo "=== xla W1: exit $?"; tail -8 "$out/xla_w1.log"
