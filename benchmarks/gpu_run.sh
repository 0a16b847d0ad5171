#!/bin/bash
# Everything the offline H200 host (../shared/gpu-host/README.md) has to show, in one call from the repo root:
# the extension (prebuilt in .prebuilt/ when carried, else built here), then the steps named in STEPS, each
# under its own time limit, in the order given. Logs go to $OUT; each step prints its tail.
#
#   STEPS="pytest soak mutation sweep bench demo autotune cb" bash benchmarks/gpu_run.sh
#   STEPS=memcheck bash benchmarks/gpu_run.sh   # compute-sanitizer over a few cuDNN cases (MEMCHECK_TESTS)
#
# mutation: the proof that the sweep catches the head-major zero-gradient bug. It needs an extension built
# against cudnn-frontend 1.27 in .prebuilt127/ (scripts/build_old_frontend.sh); the sweep must fail with the
# full-extent fallback disabled and pass with it enabled.
set -o pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/jax_ragged_attn_gpu}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(find .whl -type f -name "*.whl") \
  || exit 1
export PYTHONPATH=/tmp/site
start=$(date +%s)
if ls .prebuilt/_ext*.so >/dev/null 2>&1; then
  cp .prebuilt/_ext*.so jax_ragged_attn/  # built for this host's Python 3.12 and jaxlib 0.11.2
else
  # That host's default CXX (/opt/gcc/bin/g++, a wrapper) builds an extension that crashes inside
  # cudnn-frontend's string streams; the system compiler matches the libstdc++ the interpreter loads.
  # A wheel whose extension is copied into the source tree, not an editable install: an editable install's
  # import hook would serve its own build to the mutation step's copy of the package as well.
  CXX=/usr/bin/g++ python3 -m pip wheel --no-build-isolation --no-deps -q . -w /tmp/jra_wheel -C build-dir=/tmp/jra_build \
    2>&1 | grep -E "error|Error"
  python3 -c "import glob, zipfile; z = zipfile.ZipFile(sorted(glob.glob('/tmp/jra_wheel/*.whl'))[-1]); \
[open('jax_ragged_attn/' + n.split('/')[-1], 'wb').write(z.read(n)) for n in z.namelist() if n.startswith('jax_ragged_attn/_ext')]"
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
mutation() {  # the sweep against the frontend-1.27 build: must fail without the fallback, pass with it
  local tree=/tmp/mutation
  rm -rf "$tree" && mkdir -p "$tree" && cp -r jax_ragged_attn benchmarks "$tree/" && rm -f "$tree"/jax_ragged_attn/_ext*.so
  cp .prebuilt127/_ext*.so "$tree/jax_ragged_attn/" || return 1
  local args=(--tier gpu --num-tests "${MUTATION_N:-40}" --seed 0 --jobs "${JOBS:-8}")
  ( cd "$tree" && python3 -c "import jax_ragged_attn.backends.shared.extension as e; print('cudnn-frontend headers of this build:', e.module().frontend_version)" )
  echo "--- fallback disabled (JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK=1): the sweep must fail"
  ( cd "$tree" && JAX_RAGGED_ATTN_DISABLE_FULL_EXTENT_FALLBACK=1 python3 -m benchmarks.sweep "${args[@]}" ) \
    > "$out/mutation_disabled.log" 2>&1
  local disabled=$?
  grep -E "FAILED|cases:|failed seeds" "$out/mutation_disabled.log" | head -n 12
  grep -m 3 -E "AssertionError|Error" "$out/mutation_disabled.log"
  echo "--- fallback enabled (the default): the sweep must pass"
  ( cd "$tree" && python3 -m benchmarks.sweep "${args[@]}" ) > "$out/mutation_enabled.log" 2>&1
  local enabled=$?
  grep -E "cases:|skipped [0-9]|failed seeds" "$out/mutation_enabled.log"
  grep -m 2 -i "warn" "$out/mutation_enabled.log"
  echo "exit status with the fallback disabled: $disabled (must be 1), enabled: $enabled (must be 0)"
  [ "$disabled" -eq 1 ] && [ "$enabled" -eq 0 ]
}
for name in ${STEPS:-pytest bench demo sweep}; do
  case $name in
    pytest) step pytest "${PYTEST_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not soak" tests/ \
              --ignore=tests/test_load.py ${PYTEST_ARGS:-} ;;
    pytest_strict) step pytest_strict "${PYTEST_S:-150}" python3 -m pytest -q -rs -p no:cacheprovider \
              -m "gpu and not soak" tests/ --ignore=tests/test_load.py --jax-config=strict,x64 ${PYTEST_ARGS:-} ;;
    cpsim) step cpsim "${CPSIM_S:-300}" python3 -m benchmarks.context_parallel --implementation cudnn \
             --simulate "${CPSIM_N:-2,4,8}" --workloads "${CPSIM_W:-CP-a,CP-b,CP-c}" --calls 3 --repetitions 3 ;;
    load) step load "${LOAD_S:-120}" python3 -m pytest -q -s -rs -p no:cacheprovider -m gpu tests/test_load.py ;;
    autotune) step autotune "${AUTOTUNE_S:-120}" python3 -m benchmarks.autotune --workloads "${AUTOTUNE_W:-W1,W2,W3}" ;;
    cb) step cb "${CB_S:-240}" python3 -m benchmarks.command_buffers --out "$out/command_buffers" ;;
    soak) step soak "${SOAK_S:-240}" python3 -m pytest -q -s -rs -p no:cacheprovider -m soak tests/test_load.py ;;
    mutation) export -f mutation; export out; step mutation "${MUTATION_S:-240}" bash -c mutation ;;
    sweep) step sweep "${SWEEP_S:-40}" python3 -m benchmarks.sweep --tier gpu --num-tests "${SWEEP_N:-8}" \
             --seed "${SWEEP_SEED:-0}" --jobs "${JOBS:-1}" ;;
    sweep_kv) for impl in ${SWEEP_KV_IMPLS:-cudnn fa3}; do
                step "sweep_kv_$impl" "${SWEEP_KV_S:-120}" python3 -m benchmarks.sweep_kvcache --tier gpu \
                  --implementation "$impl" --num-tests "${SWEEP_KV_N:-40}" --seed "${SWEEP_SEED:-0}"
              done ;;
    bench) step bench "${BENCH_S:-150}" python3 -m benchmarks.attention ${BENCH_ARGS:---workloads W1,W2 --time-budget 100} \
             --out "$out" ;;
    demo) step demo "${DEMO_S:-45}" python3 examples/reversal.py --plot "$out/demo_loss.png" ;;
    # Reads and writes outside any buffer, by compute-sanitizer's memcheck: each XLA buffer its own allocation
    # (the platform allocator), so a kernel that loads past a packed buffer's last row (cuDNN is never told T)
    # is reported instead of landing in the arena. A few small cases: memcheck runs kernels 10-100x slower.
    memcheck) step memcheck "${MEMCHECK_S:-300}" env XLA_PYTHON_CLIENT_ALLOCATOR=platform \
                "${COMPUTE_SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}" --tool memcheck --error-exitcode 9 \
                python3 -m pytest -x -q -rs -p no:cacheprovider -p no:xdist ${MEMCHECK_TESTS:-\
                tests/test_kvcache_varlen.py::CudnnPackedTest::test_attention_causal_paged \
                tests/test_kvcache_varlen.py::CudnnPackedTest::test_random_mixes \
                tests/test_cudnn.py::test_head_major_and_token_major_stats_give_the_same_gradients} ;;
    lm) step lm "${LM_S:-400}" python3 -m jax_ragged_attn ${LM_ARGS:-} --plot "$out/lm_loss.png" ;;  # the main job
    model) step model "${MODEL_S:-120}" python3 -m benchmarks.attention --model ${MODEL_ARGS:---time-budget 80} --out "$out" ;;
    bottom_right) step bottom_right "${BR_S:-90}" python3 -m benchmarks.bottom_right ;;
    sinks) step sinks "${SINKS_S:-90}" python3 -m benchmarks.sinks W1 ;;
    *) echo "unknown step $name"; failed+=("$name") ;;
  esac
done
[ ${#failed[@]} -eq 0 ] || { echo "failed steps: ${failed[*]}"; exit 1; }
