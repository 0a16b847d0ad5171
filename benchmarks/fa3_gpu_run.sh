#!/bin/bash
# Issue 26 on the H200 host: the extension, then FA3's probe, timing table and semantic suite (logs in $OUT).
#   LIMIT=330 bash benchmarks/fa3_gpu_run.sh
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/fa3_gpu}; mkdir -p "$out"
start=$(date +%s); left() { echo $(( ${LIMIT:-330} - ($(date +%s) - start) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $(find .whl -type f -name "*.whl") || exit 1
export PYTHONPATH=/tmp/site
if ls .prebuilt/_ext*.so >/dev/null 2>&1; then cp .prebuilt/_ext*.so jax_ragged_attn/; else
  CXX=/usr/bin/g++ python3 -m pip wheel --no-build-isolation --no-deps -q . -w /tmp/jra_wheel -C build-dir=/tmp/jra_build 2>&1 | grep -E "error|Error"
  python3 -c "import glob, zipfile; z = zipfile.ZipFile(sorted(glob.glob('/tmp/jra_wheel/*.whl'))[-1]); \
[open('jax_ragged_attn/' + n.split('/')[-1], 'wb').write(z.read(n)) for n in z.namelist() if n.startswith('jax_ragged_attn/_ext')]"
  mkdir -p "$out/prebuilt" && cp jax_ragged_attn/_ext*.so "$out/prebuilt/"
fi
echo "extension ready after $(( $(date +%s) - start )) s"; nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader
python3 -c "import jax; print(jax.__version__, jax.devices())"
timeout 70 python3 -m benchmarks.fa3_compare --probe-only > "$out/probe.log" 2>&1; echo "probe exit $?"
grep -E "probe|error|Error|FA3" "$out/probe.log" | cut -c1-400 | tail -25
timeout 100 python3 -m benchmarks.fa3_compare --no-probe --workloads ${WORKLOADS:-W1,W2} > "$out/timing.log" 2>&1
echo "timing exit $?"; grep -vE "Warning|warn|^\s*$" "$out/timing.log" | tail -14
t=$(left); echo "pytest gets $t s"
python3 -c "import xdist" 2>/dev/null && par="-n 4" || par=""
timeout "$t" python3 -m pytest -q -rs -p no:cacheprovider $par -m gpu tests/test_semantics.py -k "${PYTEST_K:-Fa3Test}" > "$out/pytest.log" 2>&1
echo "pytest exit $?"; grep -E "passed|failed|FAILED|^E  " "$out/pytest.log" | cut -c1-300 | head -40
grep -E "SKIPPED" "$out/pytest.log" | cut -c1-200 | sort | uniq -c | head -8
t=$(left); [ "$t" -gt 15 ] && { timeout "$t" python3 -m benchmarks.attention --workloads W1 --systems ours-fa3,flash-attn3-jax \
  --quick --method plain --out "$out/bench" > "$out/bench.log" 2>&1; echo "bench exit $?"; tail -n 8 "$out/bench.log" | cut -c1-250; }
