#!/bin/bash
# One H200 call over a clean snapshot of a commit (the working tree may hold colleagues' unfinished edits):
#   git archive HEAD | gzip > .gpu/tree.tgz; then on the host: bash benchmarks/gpu_wave.sh STEP...
# (carry .gpu .whl/fa3 .whl/fe; CUDNN_PARTS below). Without .gpu/tree.tgz (the host keeps no .gpu between calls,
# and a 56 MiB part leaves no room for it) the call's own working tree is the snapshot. Steps: suite (the GPU
# tests), fa3 (fa3_compare W1,W2), or NAME=COMMAND. Logs go to $OUT; a one-line summary per step is printed last.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
out=${OUT:-/tmp/gpu_wave}; mkdir -p "$out"
src=$PWD
tree=/tmp/tree; rm -rf "$tree"; mkdir -p "$tree"
if [ -f "$src/.gpu/tree.tgz" ]; then tar -xzf "$src/.gpu/tree.tgz" -C "$tree" || exit 1
else tar -cf - --exclude=./.whl --exclude=./.gpu --exclude=./.git . | tar -xf - -C "$tree" || exit 1; fi
cd "$tree" || exit 1
# Back-to-back calls on a warm machine keep /tmp: install the wheels once.
wheels=$(find "$src/.whl" -type f -name "*.whl" | sort)
if [ "$(cat /tmp/site/.wheels 2>/dev/null)" != "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $wheels \
    || exit 1
  echo "$wheels" > /tmp/site/.wheels
fi
# PREPEND_PATH=DIR: packages that go before the host's, e.g. another JAX installed by scripts/bring_jax.sh
# --install (/tmp/jax-0.12.0.1), so the GPU suite runs on it with this extension (docs/INSTALL.md).
export PYTHONPATH=${PREPEND_PATH:+$PREPEND_PATH:}/tmp/site:$tree
t0=$(date +%s)
# EXT_SO=PATH (relative to the working tree): a prebuilt extension, e.g. a release wheel's, built against the
# newest cuDNN headers as pip users' is (the frontend enables its newer paths by min(headers, library) version).
ext_so=${EXT_SO:+$src/$EXT_SO}
ext_so=${ext_so:-$(ls "$src"/.gpu/_ext*.so 2>/dev/null | head -1)}
if [ -n "$ext_so" ]; then cp "$ext_so" jax_ragged_attn/_ext.abi3.so || exit 1; else
  CXX=/usr/bin/g++ python3 -m pip wheel --no-build-isolation --no-deps -q . -w /tmp/jra_wheel -C build-dir=/tmp/jra_build \
    2>&1 | grep -E "error|Error"
  python3 -c "import glob, zipfile; z = zipfile.ZipFile(sorted(glob.glob('/tmp/jra_wheel/*.whl'))[-1]); \
[open('jax_ragged_attn/' + n.split('/')[-1], 'wb').write(z.read(n)) for n in z.namelist() if n.startswith('jax_ragged_attn/_ext')]"
  cp jax_ragged_attn/_ext*.so "$out/"
fi
echo "extension ready after $(( $(date +%s) - t0 )) s"
# CUDNN_PARTS=DIR (CUDNN_SHA=SHA256, default DIR/SHA256): another cuDNN, brought as parts of a tar.xz of
# nvidia/cudnn/lib (the host takes 64 MiB a call; scripts/bring_cudnn.sh makes them): joined, checked, unpacked
# once per DIR, and put before the installed one (JAX's plugin loads cuDNN from the first nvidia/cudnn on the
# path; the self-check prints which library the process mapped).
if [ -n "$CUDNN_PARTS" ]; then
  cudnn_dir=/tmp/cudnn_parts/$(basename "$CUDNN_PARTS")
  if [ ! -d "$cudnn_dir/nvidia" ]; then
    cat "$src/$CUDNN_PARTS"/p? > /tmp/cudnn_parts.tar.xz || exit 1
    echo "${CUDNN_SHA:-$(cat "$src/$CUDNN_PARTS/SHA256")}  /tmp/cudnn_parts.tar.xz" | sha256sum -c || exit 1
    mkdir -p "$cudnn_dir" && tar -xJf /tmp/cudnn_parts.tar.xz -C "$cudnn_dir" && rm /tmp/cudnn_parts.tar.xz || exit 1
  fi
  export PYTHONPATH=$cudnn_dir:$PYTHONPATH LD_LIBRARY_PATH=$cudnn_dir/nvidia/cudnn/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  python3 -c "import jax; from jax_ragged_attn.backends.shared import extension as e; from jax_ragged_attn.tools.selfcheck \
import library_lines; print(e.cudnn_unavailable_reason(), e.versions()); print(*library_lines(True), sep='\n')" 2>&1 | tail -4
fi
summary=()
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2; local t=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1; local status=$?
  summary+=("$name: exit $status, $(( $(date +%s) - t )) s")
  echo "=== $name: exit $status after $(( $(date +%s) - t )) s"
}
for s in "$@"; do
  case $s in
    suite) step suite "${SUITE_S:-300}" python3 -m pytest -q -rs -p no:cacheprovider -n 8 -m "gpu and not soak" tests/ \
             --ignore=tests/test_load.py ${SUITE_K:+-k "$SUITE_K"}
           grep -E "^FAILED|^ERROR" "$out/suite.log" | cut -c1-300 | head -25; tail -1 "$out/suite.log"
           grep -E "^SKIPPED" "$out/suite.log" | sed -E 's/\[[0-9]+\] //; s/:[0-9]+:/:/' | cut -c1-160 | sort | uniq -c | sort -rn | head -8 ;;
    fa3) step fa3 "${FA3_S:-120}" python3 -m benchmarks.fa3_compare --no-probe --workloads "${WORKLOADS:-W1,W2}"
         grep -vE "Warning|warn|^\s*$" "$out/fa3.log" | tail -14 ;;
    *=*) name=${s%%=*}; step "$name" "${STEP_S:-200}" bash -c "${s#*=}"; tail -n "${TAIL:-30}" "$out/$name.log" ;;
    *) echo "unknown step $s (suite, fa3, or NAME=COMMAND)" ;;
  esac
done
printf '%s\n' "${summary[@]}"
