#!/usr/bin/env bash
# Builds jax_ragged_attn._ext with Bazel (BUILD, WORKSPACE, third_party/bazel/) from the pip-installed headers
# the CMake build uses, stages it as an importable package in build/bazel-pkg/ and checks that it imports and
# matches the CMake build. Installs nothing: it needs `bazel` (Debian: apt-get install bazel-bootstrap, Bazel
# 4.2.3, which builds offline here), g++ and the environment scripts/install.sh makes (.venv), or the Python
# named by $PYTHON with the same packages. Bazel then uses no network.
#
#   bash scripts/install.sh && bash scripts/bazel_build.sh
#   PYTHONPATH=build/bazel-pkg python -c "import jax_ragged_attn._ext"   # outside an editable install
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
# Absolute (Bazel runs it from its own directories) but not resolved: a venv's python is a symlink.
[[ $py = /* ]] || py="$PWD/$py"
[ -x "$py" ] || { echo "no Python at $py: run scripts/install.sh or set PYTHON" >&2; exit 1; }

scratch=$(mktemp -d)
# Stop the Bazel server on the way out: CI runs the test suite next on the same two cores.
trap 'rm -rf "$scratch"; bazel shutdown' EXIT
bazel build --repo_env=JAX_RAGGED_ATTN_PYTHON="$py" //:_ext

stage=$PWD/build/bazel-pkg
rm -rf "$stage"
mkdir -p "$stage"
# The whole package (its subpackages too), without the CMake build's module.
cp -r jax_ragged_attn "$stage/"
find "$stage" \( -name '_ext*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
suffix=$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
cp build/bazel-bin/jax_ragged_attn/_ext.so "$stage/jax_ragged_attn/_ext$suffix"
chmod u+w "$stage/jax_ragged_attn/_ext$suffix"

# What each build exposes: the handler names and results of the sizing math the tests check.
describe='
import jax_ragged_attn._ext as ext
print(sorted(ext.registrations()), ext.frontend_version, ext.graph_cache_stats()["capacity"],
      ext.ragged_span_bytes(100, [2, 8, 50, 1], [800, 100, 1, 1], 4), ext.token_stride_only_bytes(100, [800, 100, 1, 1], 4))
'
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')
# -S and a hand-made sys.path: the editable install's .pth adds a finder that hands out the CMake build's
# _ext whatever sys.path says.
bazel_out=$(cd "$scratch" && "$py" -S -c "
import sys
sys.path[:0] = ['$stage', '$site']
import jax_ragged_attn._ext as ext
assert ext.__file__.startswith('$stage/'), ext.__file__
$describe")
echo "Bazel build, staged as $stage/jax_ragged_attn/_ext$suffix: $bazel_out"
if cmake_out=$(cd "$scratch" && "$py" -c "$describe" 2>/dev/null); then
  echo "CMake build: $cmake_out"
  [ "$bazel_out" = "$cmake_out" ] || { echo "the Bazel and CMake builds differ" >&2; exit 1; }
else
  echo "no CMake build importable with $py to compare against"
fi
