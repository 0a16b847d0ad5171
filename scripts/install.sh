#!/usr/bin/env bash
# The developer's install: creates the virtual environment .venv (or $VENV) and installs jax_ragged_attn into
# it editable, with its [test,flax,tools] extras. Safe to run again: it only adds what is missing, and
# rebuilds only the C++ files that changed. (A user's install is plain `pip install .`: README "Installing".)
#
# The build runs without build isolation, so that a rebuild reuses this environment's CMake tree
# (build/env-<hash of the venv path>/, one per environment) instead of starting from scratch. Its build
# requirements are therefore installed here, from pyproject.toml's [build-system] requires, the nvidia-*
# header wheels with --no-deps (their headers are all the build reads; the libraries they would pull in, such
# as cuBLAS, stay off a CPU machine). jaxlib is the one jax installs: its XLA FFI headers match it exactly.
# With an NVIDIA driver present it installs jax[cuda13], which brings the cuDNN the extension loads at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
t0=$SECONDS
say() { printf '==> %s\n' "$*"; }
took() { printf '    done in %d s\n' $((SECONDS - $1)); }
# run_shown CMD...: runs CMD with its output in a log and shows its progress as it comes: the compile's steps
# ([3/9] Building CXX object ...: CMake and ninja, which pip -v streams), and whenever 15 s pass without one, a
# heartbeat line with the log's latest news (pip's Collecting / Installing, CMake's -- lines). Nothing is
# minutes of silence. On failure the log's end is printed and the script stops.
run_shown() {
  local log pid shown=0 quiet_since=$SECONDS since=$SECONDS line steps
  log=$(mktemp "${TMPDIR:-/tmp}/jax_ragged_attn_install.XXXXXX")
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    mapfile -t steps < <(grep -E '^\s*\[[0-9]+/[0-9]+\] ' "$log" | tail -n +$((shown + 1)))
    for line in "${steps[@]}"; do
      line=${line#"${line%%[![:space:]]*}"}
      printf '    %s\n' "${line:0:110}"
    done
    if ((${#steps[@]})); then
      shown=$((shown + ${#steps[@]})) quiet_since=$SECONDS
    elif ((SECONDS - quiet_since >= 15)); then
      line=$(grep -E '^\s*(\*\*\*|-- |Collecting|Downloading|Installing|Building|Successfully)' "$log" | tail -n 1 || true)
      line=${line#"${line%%[![:space:]]*}"}
      printf '    ... %d s: %s\n' $((SECONDS - since)) "${line:0:90}"
      quiet_since=$SECONDS
    fi
  done
  if ! wait "$pid"; then
    tail -n 60 "$log"
    printf 'failed: %s (the whole log: %s)\n' "$*" "$log" >&2
    exit 1
  fi
  rm -f "$log"
}

if [ ! -x "$venv/bin/python" ]; then
  say "creating $venv with $(python3 --version)"
  python3 -m venv "$venv"
fi
py="$venv/bin/python"
venv_abs=$(cd "$venv" && pwd -P)

t=$SECONDS
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  jax='jax[cuda13]'
else
  jax='jax'
fi
say "installing $jax, pip and the build tools into $venv (about a minute the first time, seconds after)"
"$py" -m pip install -q --upgrade pip
# Every build requirement except jaxlib (the FFI headers come from the jaxlib that jax brings) and the header
# wheels, which follow with --no-deps.
mapfile -t build_requires < <("$py" -c '
import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]:
    print(r)')
tools=() headers=()
for r in "${build_requires[@]}"; do
  case $r in
    jaxlib*) ;;
    nvidia-*) headers+=("$r") ;;
    *) tools+=("$r") ;;
  esac
done
run_shown "$py" -m pip install "$jax" "${tools[@]}" cmake ninja
run_shown "$py" -m pip install --no-deps "${headers[@]}"
took $t

t=$SECONDS
build_dir="build/env-$(printf %s "$venv_abs" | sha1sum | cut -c1-8)/{wheel_tag}"
say "building the C++ extension into $build_dir and installing jax_ragged_attn[test,flax,tools] editable"
say "(a full build: about 2 minutes on 2 cores, 125 s measured on a clean clone 2026-12-03; a rebuild only recompiles what changed)"
run_shown "$py" -m pip install -v --no-build-isolation -C build-dir="$build_dir" -e '.[test,flax,tools]'
took $t
say "ready in $((SECONDS - t0)) s: $("$py" -c 'import jax_ragged_attn.backends.cudnn.extension as e; print(e.versions())')"
