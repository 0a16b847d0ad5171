#!/usr/bin/env bash
# Checks one JAX release, the day it appears, the way a user meets it: builds this package's wheel for the named
# Python as a release does (scripts/check_wheel.sh: an isolated build against the oldest supported jaxlib's XLA
# FFI headers, then the wheel's own checks in an environment with that JAX and no compiler), installs the wheel
# into a fresh environment with the named JAX (and, on a GPU host, the named cuDNN) and runs there, from a copy of
# tests/ outside the source tree, the files that decide whether a release works with this package: the semantic
# suite, the KV-cache and softcap files, the extension's registrations and sizing, and the handler contract (the
# handlers built against the oldest FFI headers, called through a call frame compiled against this JAX's);
# then the main job. On a GPU host the same files run their GPU tests too. .ci/run's newest-JAX stage is this
# script (`--python 3.13 --jax latest`).
#
#   bash scripts/check_release.sh --python 3.13 --jax 0.12.0.1
#   bash scripts/check_release.sh --python 3.13 --jax latest       # what `pip install jax` gives that Python today
#   bash scripts/check_release.sh --python 3.12 --jax 0.12.0.1 --cudnn 9.28.1   # GPU host: jax[cuda13], that cuDNN
#   bash scripts/check_release.sh --python 3.13 --jax 0.12.0.1 --tests "tests/test_flax.py" --no-main-job
#
# --python takes a version (found as $(pyenv root)/versions/X.Y*/bin/pythonX.Y, then pythonX.Y on PATH), a list of
# them to take the first found ("3.13,3.12"), or a path.
# It needs a package index (or PIP_FIND_LINKS) with that JAX; the wheel build also downloads the CUDA header
# wheels once (~1.2 GB). Ends with a line for docs/INSTALL.md's table of tested combinations.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { sed -n '12,16p' "$0" | sed 's/^# \{0,1\}//'; }
want_python="" jax_version="" cudnn="" main_job=1
tests=(tests/test_semantics.py tests/test_kvcache.py tests/test_softcap.py tests/test_extension.py
       tests/test_handler_contract.py)
while (($#)); do
  case $1 in
    --python) want_python=$2; shift 2 ;;
    --jax) jax_version=$2; shift 2 ;;
    --cudnn) cudnn=$2; shift 2 ;;
    --tests) read -ra tests <<< "$2"; shift 2 ;;
    --no-main-job) main_job=0; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "check_release: unknown argument $1" >&2; usage >&2; exit 2 ;;
  esac
done
[ -n "$want_python" ] && [ -n "$jax_version" ] || { usage >&2; exit 2; }
say() { printf '==> %s\n' "$*"; }
fail() { printf 'check_release: %s\n' "$*" >&2; exit 1; }
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

work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
[ -n "${WORK:-}" ] || trap 'rm -rf "$work"' EXIT
env="$work/env"
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
DIST=$dist PYTHON=$python JAX=$jax_version bash scripts/check_wheel.sh
wheel=$(ls "$dist"/*.whl)

# 2. That wheel with its [test,flax,tools] extras and this JAX (and cuDNN) in the fresh environment.
say "installing $(basename "$wheel")[test,flax,tools] and $jax_spec${cudnn:+ and nvidia-cudnn-cu13==$cudnn}"
"$env/bin/python" -m pip install -q "$wheel[test,flax,tools]" "$jax_spec" ${cudnn:+"nvidia-cudnn-cu13==$cudnn"}
read -r py_version jax_got jaxlib_got cudnn_got platform < <("$env/bin/python" - <<'EOF'
import importlib.metadata as m
import sys

import jax
import jaxlib

try:
    cudnn = m.version("nvidia-cudnn-cu13")
except m.PackageNotFoundError:
    cudnn = "-"
print(sys.version.split()[0], jax.__version__, jaxlib.__version__, cudnn, jax.devices()[0].platform)
EOF
)
versions="Python $py_version, jax $jax_got, jaxlib $jaxlib_got${cudnn:+, cuDNN wheel $cudnn_got}"
versions+=", JAX's backend $platform"
say "$versions"

# 3. The files, from a copy of tests/ (the package must come from the environment, not from this tree), and the
#    main job, run in a scratch directory (it writes its loss plot there).
mkdir -p "$work/run"
cp -r tests "$work/run/tests"
cp pyproject.toml "$work/run/"  # pytest's settings only: markers, the tiers
t=$SECONDS
say "pytest ${tests[*]} (their fast tier, as the README's command runs them)"
(cd "$work/run" && unset PYTHONPATH && "$env/bin/python" -m pytest -q -rs -n 2 -p no:cacheprovider "${tests[@]}") 2>&1 |
  tee "$work/pytest.log"
summary=$(tail -n 1 "$work/pytest.log" | tr -d '=' | xargs)  # "389 passed, 454 skipped in 120.00s (0:02:00)"
say "tests: $summary in $((SECONDS - t)) s"
main=""
if ((main_job)); then
  t=$SECONDS
  say "the main job: python -m jax_ragged_attn"
  (cd "$work/run" && "$env/bin/python" -m jax_ragged_attn)
  main=", main job in $((SECONDS - t)) s"
fi
say "release check passed in $((SECONDS - t0)) s: $versions"
machine="CPU, $(nproc) cores"
((gpu)) && machine=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
say "for docs/INSTALL.md's table: | $py_version | $jax_got | $jaxlib_got | ${cudnn:+$cudnn_got} | $machine:" \
    "scripts/check_release.sh | $(date +%F) | ${tests[*]##*/}: $summary$main |"
