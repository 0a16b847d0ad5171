#!/usr/bin/env bash
# Checks one JAX release, the day it appears, the way a user meets it: builds this package's wheel for the named
# Python as a release does (scripts/check_wheel.sh: an isolated build against the oldest supported jaxlib's XLA
# FFI headers, then the wheel's own checks in an environment with that JAX and no compiler), installs the wheel
# into a fresh environment with the named JAX (and, on a GPU host, the named cuDNN) and runs there, from a copy of
# tests/ outside the source tree, the files that decide whether a release works with this package: the semantic
# suite, the KV-cache and softcap files, the extension's registrations and sizing, and the handler contract (the
# handlers built against the oldest FFI headers, called through a call frame compiled against this JAX's);
# then the main job. On a GPU host (nvidia-smi sees one) the default instead is every GPU-marked test but the soak
# (`-m "gpu and not soak"` over tests/, -n 8), then the main job. .ci/run's newest-JAX stage is this script
# (`--python 3.13,3.12 --jax latest`).
#
#   bash scripts/check_release.sh --python 3.13 --jax 0.12.0.1
#   bash scripts/check_release.sh --python 3.13 --jax latest       # what `pip install jax` gives that Python today
#   bash scripts/check_release.sh --python 3.12 --jax 0.12.0.1 --cudnn 9.28.1   # GPU host: jax[cuda13], that cuDNN
#   bash scripts/check_release.sh --python 3.13 --jax 0.12.0.1 --tests "tests/test_flax.py" --no-main-job
#   bash scripts/check_release.sh --python "$(command -v python3)" --jax 0.12.0.1 --wheels .whl/jax-0.12.0.1 \
#     --wheels .whl/flax --logs "$OUT"        # the offline GPU host: no index, the wheels scripts/bring_jax.sh packed
#
# --python takes a version (found as $(pyenv root)/versions/X.Y*/bin/pythonX.Y, then pythonX.Y on PATH), a list of
# them to take the first found ("3.13,3.12"), or a path.
# It needs a package index (or PIP_FIND_LINKS) with that JAX; the wheel build also downloads the CUDA header
# wheels once (~1.2 GB). Ends with a line for docs/INSTALL.md's table of tested combinations.
#
# Offline (--wheels DIR, repeatable; docs/INSTALL.md, "Checking a new release"): no index and no fresh environment.
# --python's own environment is used (on the GPU host: pytest, xdist, hypothesis, numpy, scipy, cuDNN and the build
# tools are installed there), with the wheels first on PYTHONPATH, so its own JAX stays as it is: a DIR made by
# scripts/bring_jax.sh (parts and MANIFEST) is joined, checked and installed by `bring_jax.sh --install` (into
# /tmp/jax-<version>, kept for a second run on the same machine; DIR-deps beside it supplies a newer numpy & co.
# only where the environment's own is too old), any other DIR's *.whl are installed with --no-deps. A
# jax_ragged_attn wheel among them is the one tested (e.g. the cp312-abi3 release wheel, built against jaxlib
# 0.10's FFI headers); otherwise this tree is built into one with `pip wheel --no-build-isolation`, against the
# environment's own jaxlib (the new JAX kept off PYTHONPATH: older FFI headers run on a newer jaxlib, docs/INSTALL.md
# "Building"), with $CXX, else /usr/bin/g++ where that exists (on the GPU host name CXX=/usr/bin/g++: its
# environment's CXX, /opt/gcc/bin/g++, builds an extension whose every cuDNN graph query segfaults with
# JAX 0.12.0.1). --no-extension builds it without the C++ extension (a CPU check of the offline
# path only). The main job runs when flax is importable (--wheels .whl/flax on the host). --logs DIR keeps the
# build, pytest and main job logs; --tests "" runs no tests (the main job alone); --workers N sets pytest's
# workers (2; 8 on a GPU, each
# with XLA_PYTHON_CLIENT_PREALLOCATE=false, as the GPU suite has run at -n 8 and -n 12 without a cap; set
# XLA_PYTHON_CLIENT_MEM_FRACTION to cap each); SUITE_S=seconds limits the GPU suite, whose failures then still
# end with the table's line (and exit status 1).
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
usage() { sed -n '13,19p' "$0" | sed 's/^# \{0,1\}//'; }
want_python="" jax_version="" cudnn="" main_job=1
tests=(tests/test_semantics.py tests/test_kvcache.py tests/test_softcap.py tests/test_extension.py
       tests/test_handler_contract.py tests/test_validation.py tests/test_checks.py)
wheel_dirs=() no_extension=0 logs="" workers="" tests_given=0
while (($#)); do
  case $1 in
    --python) want_python=$2; shift 2 ;;
    --jax) jax_version=$2; shift 2 ;;
    --cudnn) cudnn=$2; shift 2 ;;
    --tests) read -ra tests <<< "$2"; tests_given=1; shift 2 ;;
    --no-main-job) main_job=0; shift ;;
    --wheels) wheel_dirs+=("$(cd "$caller" && cd "$2" && pwd)") || { echo "check_release: no folder $2" >&2; exit 2; }
              shift 2 ;;
    --no-extension) no_extension=1; shift ;;
    --logs) case $2 in /*) logs=$2 ;; *) logs=$caller/$2 ;; esac; mkdir -p "$logs"; logs=$(cd "$logs" && pwd); shift 2 ;;
    --workers) workers=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "check_release: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
[ -n "$want_python" ] && [ -n "$jax_version" ] || { usage >&2; exit 2; }
say() { printf '==> %s\n' "$*"; }
fail() { printf 'check_release: %s\n' "$*" >&2; exit 1; }
offline=$((${#wheel_dirs[@]} > 0))
if ((offline)); then
  [ "$jax_version" != latest ] || fail "--jax latest asks a package index; offline (--wheels) name the version brought"
  [ -z "$cudnn" ] || fail "--cudnn installs a cuDNN wheel from an index; offline, install one into the environment first"
else
  ((!no_extension)) || fail "--no-extension is for the offline path (--wheels) only"
fi
t0=$SECONDS

# A pyenv shim named pythonX.Y exists for every installed version but runs only the selected one: each candidate
# is tried, not just found.
python=""
if [[ $want_python == */* ]]; then
  python=$want_python
else
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  IFS=, read -ra wanted <<< "$want_python"
  for version in "${wanted[@]}"; do
    minor=$(echo "$version" | cut -d. -f1-2)  # 3.13 of 3.13 or 3.13.0
    for candidate in $(ls -d "$root"/versions/"$version"*/bin/python"$minor" 2>/dev/null | sort -rV) "python$minor"; do
      if [ "$("$candidate" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "$minor" ]; then
        python=$(command -v "$candidate")
        break 2
      fi
    done
  done
fi
if [ -z "$python" ] || ! "$python" -c 'import sys' >/dev/null 2>&1; then
  first=${want_python%%,*}
  fail "no Python ${want_python//,/ or } on this machine: install one with \`pyenv install $first\` (or the OS's" \
       "python$first and python$first-venv packages), or pass --python /path/to/python"
fi

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
[ -n "$cudnn" ] && ((!gpu)) && fail "--cudnn $cudnn needs a GPU host (nvidia-smi sees none here)"
workers=${workers:-$( ((gpu)) && echo 8 || echo 2)}
pytest_args=(-q -rs -n "$workers" -p no:cacheprovider)
what="" suite=0
if ((gpu)) && ((!tests_given)); then
  suite=1
  # The GPU suite (the load tests and the soak are run on their own: tests/test_load.py, -m soak).
  tests=(tests)
  pytest_args=(-q -rfEs -n "$workers" -p no:cacheprovider -m "gpu and not soak" --ignore=tests/test_load.py)
  what="every GPU-marked test but the soak (-m 'gpu and not soak', -n $workers)"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
fi

work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT
log_dir=${logs:-$work}
env="$work/env"
if ((offline)); then
  # No index, no fresh environment: --python's own, with the brought wheels first on PYTHONPATH.
  site="$work/site" jax_site=""
  mkdir -p "$site"
  say "offline: $("$python" --version) ($python) with its own packages; the wheels of ${wheel_dirs[*]} first on its path"
  for dir in "${wheel_dirs[@]}"; do
    if grep -qx 'kind jax' "$dir/MANIFEST" 2>/dev/null; then
      [ "$(sed -n 's/^version //p' "$dir/MANIFEST")" = "$jax_version" ] ||
        fail "$dir holds jax $(sed -n 's/^version //p' "$dir/MANIFEST"), not $jax_version"
      jax_site="/tmp/jax-$jax_version"  # kept: a second run on the same machine skips joining and installing
      PYTHON=$python bash scripts/bring_jax.sh --install "$dir" --target "$jax_site"
    elif grep -qx 'kind fallback' "$dir/MANIFEST" 2>/dev/null; then
      :  # bring_jax.sh --install takes DIR-deps beside its DIR itself, and only for an unmet requirement
    else
      ls "$dir"/*.whl >/dev/null 2>&1 || fail "$dir has neither *.whl nor a bring_jax.sh MANIFEST"
      say "installing $(cd "$dir" && echo *.whl) into $site (--no-deps)"
      "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$dir"/*.whl
    fi
  done
  pythonpath=${jax_site:+$jax_site:}$site
  py=(env "PYTHONPATH=$pythonpath" "$python")
else
  py=("$env/bin/python")
fi
if ((!offline)); then
say "a fresh environment with $("$python" --version) in $env"
"$python" -m venv "$env"
"$env/bin/python" -m pip install -q --upgrade pip
if [ "$jax_version" = latest ]; then
  # What `pip install jax` picks for this Python today: asked of the index, then pinned everywhere below.
  "$env/bin/python" -m pip install -q jax
  jax_version=$("$env/bin/python" -c 'import jax; print(jax.__version__)')
  say "the newest JAX pip offers $("$python" --version): $jax_version"
fi
jax_spec="jax==$jax_version"
((gpu)) && jax_spec="jax[cuda13]==$jax_version"

# 1. The wheel, built for this Python from the sdist, and its own checks with this JAX.
dist="$work/dist"
# Its installed tests are among step 3's (from the same wheel with the same JAX): here the self-check alone.
DIST=$dist PYTHON=$python JAX=$jax_version WHEEL_TESTS="" bash scripts/check_wheel.sh
wheel=$(ls "$dist"/*.whl)

# 2. That wheel with its [test,flax,tools] extras and this JAX (and cuDNN) in the fresh environment.
say "installing $(basename "$wheel")[test,flax,tools] and $jax_spec${cudnn:+ and nvidia-cudnn-cu13==$cudnn}"
"$env/bin/python" -m pip install -q "$wheel[test,flax,tools]" "$jax_spec" ${cudnn:+"nvidia-cudnn-cu13==$cudnn"}
else
  # 1-2 offline: a jax_ragged_attn wheel brought along, or one built here from this tree.
  wheel=$(find "${wheel_dirs[@]}" -maxdepth 1 -name 'jax_ragged_attn-*.whl' | sort -V | tail -n 1)
  if [ -z "$wheel" ]; then
    build=(--no-build-isolation --no-deps -w "$work/dist" -C build-dir="$work/build")
    ((no_extension)) && build+=(-C wheel.cmake=false -C wheel.py-api=py3)  # pure Python, as install.sh's option
    cxx=${CXX:-}
    [ -z "$cxx" ] && [ -x /usr/bin/g++ ] && cxx=/usr/bin/g++
    t=$SECONDS
    say "building this tree's wheel${cxx:+ with CXX=$cxx}$( ((no_extension)) && echo ", without its C++ extension")," \
        "against this environment's own jaxlib $(env -u PYTHONPATH "$python" -c 'import jaxlib; print(jaxlib.__version__)' \
        2>/dev/null || echo '(none)') (the new one kept off PYTHONPATH)"
    (unset PYTHONPATH; [ -z "$cxx" ] || export CXX=$cxx; "$python" -m pip wheel -v "${build[@]}" .) > "$log_dir/build.log" 2>&1 ||
      { tail -n 40 "$log_dir/build.log"; fail "the build failed (log: $log_dir/build.log)"; }
    grep -E "^ *-- (XLA FFI|cudnn-frontend|cuDNN|CUDA runtime)" "$log_dir/build.log" | sed "s/^ */    /" || true
    wheel=$(ls "$work"/dist/jax_ragged_attn-*.whl)
    say "built $(basename "$wheel") in $((SECONDS - t)) s"
  fi
  say "installing $(basename "$wheel") into $site (--no-deps)"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel"
fi
# From $work: python's first path entry is its working directory, and this tree's jax_ragged_attn must not answer.
read -r py_version jax_got jaxlib_got cudnn_got platform package < <(cd "$work" && "${py[@]}" - <<'EOF'
import importlib.metadata as m
import os
import sys

import jax
import jaxlib

try:
    cudnn = m.version("nvidia-cudnn-cu13")
except m.PackageNotFoundError:
    cudnn = "-"
try:
    import jax_ragged_attn
    package = os.path.dirname(jax_ragged_attn.__file__)
except ImportError:
    package = "-"
print(sys.version.split()[0], jax.__version__, jaxlib.__version__, cudnn, jax.devices()[0].platform, package)
EOF
)
((offline && gpu)) && [ -z "$cudnn" ] && cudnn=$cudnn_got  # the table's cuDNN column: the environment's own
versions="Python $py_version, jax $jax_got, jaxlib $jaxlib_got${cudnn:+, cuDNN wheel $cudnn_got}"
versions+=", JAX's backend $platform"
say "$versions"
if ((offline)); then
  [ "$jax_got" = "$jax_version" ] || fail "jax $jax_got was imported, not $jax_version (PYTHONPATH=$pythonpath)"
  [ "$package" = "$site/jax_ragged_attn" ] || fail "jax_ragged_attn came from $package, not from $site"
  ((!gpu)) || [ "$platform" = gpu ] || fail "jax $jax_got sees no GPU here: ${py[*]} -c 'import jax; jax.devices()'"
fi

# 3. The files, from a copy of tests/ (the package must come from the environment, not from this tree), and the
#    main job, run in a scratch directory (it writes its loss plot there).
mkdir -p "$work/run"
cp -r tests "$work/run/tests"
cp pyproject.toml "$work/run/"  # pytest's settings only: markers, the tiers
# Some GPU tests import the repository's harnesses (benchmarks/) or load its demo (examples/) at collection.
((gpu || offline)) && cp -r benchmarks examples "$work/run/"
t=$SECONDS
failed=() summary=""
if ((tests_given)) && ((${#tests[@]} == 0)); then
  what="no tests (--tests '')" summary="not run"
elif ((suite)); then
  # The GPU suite: its log in full to $log_dir, here the failures, the summary and the skip reasons counted.
  say "pytest: $what"
  limit=()
  [ -n "${SUITE_S:-}" ] && limit=(timeout "$SUITE_S")
  (cd "$work/run" && unset PYTHONPATH && "${limit[@]}" "${py[@]}" -m pytest "${pytest_args[@]}" "${tests[@]}") \
    > "$log_dir/pytest.log" 2>&1 || failed+=("pytest (exit $?)")
  grep -E "^(FAILED|ERROR)" "$log_dir/pytest.log" | cut -c1-300 | head -n 30 || true
  grep -E "^SKIPPED" "$log_dir/pytest.log" | sed -E 's/\[[0-9]+\] //; s/:[0-9]+:/:/' | cut -c1-160 | sort | uniq -c |
    sort -rn | head -n 12 || true
else
  what=${tests[*]##*/}
  say "pytest ${tests[*]} (their fast tier, as the README's command runs them)"
  (cd "$work/run" && unset PYTHONPATH && "${py[@]}" -m pytest "${pytest_args[@]}" "${tests[@]}") 2>&1 |
    tee "$log_dir/pytest.log"
fi
[ -n "$summary" ] || summary=$(tail -n 1 "$log_dir/pytest.log" | tr -d '=' | xargs)  # "389 passed, 454 skipped in 120.00s (0:02:00)"
say "tests: $summary in $((SECONDS - t)) s"
main=""
if ((main_job)) && ((offline)) && ! "${py[@]}" -c 'import flax' >/dev/null 2>&1; then
  say "the main job: not run, flax is not importable here (bring its wheels: --wheels .whl/flax)"
  main=", main job not run (no flax)"
elif ((main_job)); then
  t=$SECONDS
  say "the main job: python -m jax_ragged_attn"
  if [ -n "$logs" ]; then
    (cd "$work/run" && "${py[@]}" -m jax_ragged_attn) 2>&1 | tee "$logs/main_job.log" || failed+=("main job")
  elif ((suite)); then
    (cd "$work/run" && "${py[@]}" -m jax_ragged_attn) || failed+=("main job")
  else
    (cd "$work/run" && "${py[@]}" -m jax_ragged_attn)
  fi
  main=", main job in $((SECONDS - t)) s"
fi
((${#failed[@]})) || say "release check passed in $((SECONDS - t0)) s: $versions"
machine="CPU, $(nproc) cores"
((gpu)) && machine=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
how="scripts/check_release.sh"
((offline)) && how+=" --wheels (offline, $(basename "$wheel" .whl)$( ((no_extension)) && echo ", no extension"))"
say "for docs/INSTALL.md's table: | $py_version | $jax_got | $jaxlib_got | ${cudnn:+$cudnn_got} | $machine:" \
    "$how | $(date +%F) | $what: $summary$main |"
((${#failed[@]} == 0)) || fail "failed: ${failed[*]} (logs: $log_dir)"
