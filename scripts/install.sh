#!/usr/bin/env bash
# The developer's install: creates the virtual environment .venv (or $VENV, with the Python named by $PYTHON,
# default python3) and installs jax_ragged_attn into it editable, with its [test,flax,tools] extras. Safe to run
# again: it only adds what is missing, and rebuilds only the C++ files that changed. (A user's install is plain
# `pip install .`: docs/INSTALL.md.)
#
#   bash scripts/install.sh                  # the C++ extension built: what the README's commands and CI run
#   bash scripts/install.sh --no-extension   # CPU-only and quick: no C++ build, no CUDA header wheels
#
# The build runs without build isolation, so that a rebuild reuses this environment's CMake tree
# (build/env-<hash of the venv path>/, one per environment) instead of starting from scratch. Its build
# requirements are therefore installed here, from pyproject.toml's [build-system] requires and the extension's
# [tool.scikit-build] build.requires, the nvidia-* header wheels with --no-deps (their headers are all the build
# reads; the libraries they would pull in, such as cuBLAS, stay off a CPU machine). jaxlib is the one jax
# installs: its XLA FFI headers match it exactly (the wheels built by scripts/check_wheel.sh use the oldest
# supported jaxlib's instead, docs/INSTALL.md).
# With an NVIDIA driver present it installs jax[cuda13], which brings the cuDNN the extension loads at run time.
#
# --no-extension skips the C++ extension (CMake, ninja, nanobind and the 1.1 GB of CUDA header wheels): the
# xla path and everything in Python work, the cuDNN path declines with "the C++ extension is not built", and the
# tests that call the extension itself (test_extension.py, test_handler_contract.py, test_config_fields.py, ...)
# fail. It is for trying the package on a machine without a GPU; the README's commands and CI build it, because
# the extension's CPU-testable parts (registrations, sizing, the handlers' contract) are tested there.
set -euo pipefail
cd "$(dirname "$0")/.."
extension=1
for arg in "$@"; do
  case $arg in
    --no-extension) extension=0 ;;
    -h | --help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "install.sh: unknown option $arg (--no-extension, --help)" >&2; exit 2 ;;
  esac
done
venv=${VENV:-.venv}
python=${PYTHON:-python3}
t0=$SECONDS
say() { printf '==> %s\n' "$*"; }
took() { printf '    done in %d s\n' $((SECONDS - $1)); }

# compiling PID: what the build under process PID is on now, e.g. "ffi/handlers.cc, ffi/graph_build.cc" (each
# compiler driver's -c argument, the repository's or nanobind's part of the path), "linking" while only the
# linker runs, nothing otherwise.
compiling() {
  ps -e -o pid=,ppid=,args= | awk -v root="$1" -v repo="$PWD/" '
    { pid[NR] = $1; parent[NR] = $2; $1 = ""; $2 = ""; args[NR] = $0 }
    END {
      ours[root] = 1
      for (grew = 1; grew;) {
        grew = 0
        for (i = 1; i <= NR; i++) if (!(pid[i] in ours) && (parent[i] in ours)) { ours[pid[i]] = 1; grew = 1 }
      }
      for (i = 1; i <= NR; i++) {
        if (!(pid[i] in ours)) continue
        n = split(args[i], word, " ")
        for (j = 1; j < n; j++) if (word[j] == "-c" && word[j + 1] ~ /\.(cc|cpp|c)$/) {
          source = word[j + 1]
          sub(repo, "", source); sub(/.*\/nanobind\//, "nanobind/", source); sub(/.*\/ffi\//, "ffi/", source)
          if (!(source in seen)) sources = sources (sources ? ", " : "") source
          seen[source] = 1
        }
        if (word[1] ~ /(^|\/)(ld|collect2|ar)$/) linking = 1
      }
      if (sources) print sources; else if (linking) print "linking"
    }'
}

# run_shown CMD...: runs CMD with its output in a log and shows its progress as it comes: each compile step as
# ninja finishes it ("[3/24] compiled ffi/handlers.cc"; CMake and ninja, which pip -v streams), and whenever
# 15 s pass without one, a heartbeat that names what the compiler is on ("... 41 s: compiling ffi/graph_build.cc,
# ffi/handlers.cc (12/24 done)") or else the log's latest news (pip's Collecting / Installing, CMake's --
# lines). On failure the log's end is printed and the script stops.
run_shown() {
  local log pid shown=0 quiet_since=$SECONDS since=$SECONDS line steps done_steps="" now
  log=$(mktemp "${TMPDIR:-/tmp}/jax_ragged_attn_install.XXXXXX")
  "$@" >"$log" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    sleep 2
    mapfile -t steps < <(grep -E '^\s*\[[0-9]+/[0-9]+\] ' "$log" | tail -n +$((shown + 1)))
    for line in "${steps[@]}"; do
      line=${line#"${line%%[![:space:]]*}"}
      done_steps=${line%%]*}
      done_steps=${done_steps#[}
      # Ninja prints a step when it ends: "Building CXX object CMakeFiles/_ext.dir/ffi/x.cc.o" has been built.
      if [[ $line =~ ^(\[[0-9]+/[0-9]+\])\ Building\ [A-Z]+\ object\ (.*)\.o$ ]]; then
        line="${BASH_REMATCH[1]} compiled ${BASH_REMATCH[2]#CMakeFiles/*.dir/}"
        [[ $line == */nanobind/* ]] && line="${line%% compiled *} compiled nanobind/${line##*/nanobind/}"
      elif [[ $line =~ ^(\[[0-9]+/[0-9]+\])\ Linking\ [A-Z]+\ [a-z\ ]*\ (.*)$ ]]; then
        line="${BASH_REMATCH[1]} linked ${BASH_REMATCH[2]}"
      fi
      printf '    %s\n' "${line:0:110}"
    done
    if ((${#steps[@]})); then
      shown=$((shown + ${#steps[@]})) quiet_since=$SECONDS
    elif ((SECONDS - quiet_since >= 15)); then
      now=$(compiling "$pid")
      if [ -n "$now" ]; then
        line="compiling $now${done_steps:+ ($done_steps done)}"
        [ "$now" = linking ] && line="linking${done_steps:+ ($done_steps done)}"
      else
        line=$(grep -E '^\s*(\*\*\*|-- |Collecting|Downloading|Installing|Building|Successfully)' "$log" |
               tail -n 1 || true)
        line=${line#"${line%%[![:space:]]*}"}
      fi
      printf '    ... %d s: %s\n' $((SECONDS - since)) "${line:0:100}"
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
  if ! command -v "$python" >/dev/null; then
    echo "install.sh: no $python here (set PYTHON to a Python 3.11 or newer)" >&2
    exit 1
  fi
  say "creating $venv with $("$python" --version)"
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
venv_abs=$(cd "$venv" && pwd -P)

t=$SECONDS
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  jax='jax[cuda13]'
else
  jax='jax'
fi
"$py" -m pip install -q --upgrade pip
# Every build requirement except jaxlib (the FFI headers come from the jaxlib that jax brings) and the header
# wheels, which follow with --no-deps.
mapfile -t build_requires < <("$py" -c '
import tomllib
pyproject = tomllib.load(open("pyproject.toml", "rb"))
for r in pyproject["build-system"]["requires"] + pyproject["tool"]["scikit-build"]["build"]["requires"]:
    print(r)')
tools=() headers=()
for r in "${build_requires[@]}"; do
  case $r in
    jaxlib*) ;;
    nvidia-*) headers+=("$r") ;;
    scikit-build-core*) tools+=("$r") ;;
    *) if ((extension)); then tools+=("$r"); fi ;;
  esac
done
if ((extension)); then
  say "installing $jax, the build tools and the CUDA header wheels into $venv (20-30 s with a nearby package index)"
  run_shown "$py" -m pip install "$jax" "${tools[@]}" cmake ninja
  run_shown "$py" -m pip install --no-deps "${headers[@]}"
else
  say "installing $jax and scikit-build-core into $venv (no C++ build tools, no CUDA header wheels: --no-extension)"
  run_shown "$py" -m pip install "$jax" "${tools[@]}"
fi
took $t

t=$SECONDS
if ((extension)); then
  build_dir="build/env-$(printf %s "$venv_abs" | sha1sum | cut -c1-8)/{wheel_tag}"
  say "building the C++ extension into $build_dir and installing jax_ragged_attn[test,flax,tools] editable"
  say "(a full build: 15 ninja steps, nanobind's 11 sources and ours in two unity units, about 5 CPU-minutes;"
  say " a rebuild only recompiles what changed)"
  run_shown "$py" -m pip install -v --no-build-isolation -C build-dir="$build_dir" -e '.[test,flax,tools]'
else
  say "installing jax_ragged_attn[test,flax,tools] editable, without its C++ extension (--no-extension)"
  # No CMake run (wheel.cmake=false); with nothing compiled the editable wheel is pure Python (py3).
  run_shown "$py" -m pip install --no-build-isolation -C wheel.cmake=false -C wheel.py-api=py3 -e '.[test,flax,tools]'
fi
took $t
"$py" - "$((SECONDS - t0))" <<'PY'
import sys

import jax
import jaxlib

try:
    from jax_ragged_attn import _ext  # noqa: F401
    extension = "the C++ extension built"
except ImportError:
    extension = "no C++ extension (the cuDNN path declines; the xla path runs everything)"
print(f"==> ready in {sys.argv[1]} s: Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib "
      f"{jaxlib.__version__}, {extension}")
PY
