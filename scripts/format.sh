#!/usr/bin/env bash
# Applies what scripts/lint.sh checks, in place: ruff's safe fixes (import order, unused imports, noqa comments
# the configuration makes unnecessary, newer syntax), then ruff's formatter over the Python and clang-format
# over the C++ of ffi/ and tests/native/. It then lists what is left for a person: ruff findings without a safe
# fix and mypy's errors.
#
#   bash scripts/format.sh            # the tools installed in .venv (PYTHON=path/to/python for another one;
#                                     # bash scripts/lint.sh --install installs the pinned ones)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || { echo "no Python at $py: run scripts/install.sh or set PYTHON" >&2; exit 1; }
bin=$(dirname "$py")
shopt -s nullglob
cxx=(ffi/*.cc ffi/*.h ffi/*.cu tests/native/*.cc tests/native/*.h)
# Fixes first: a fix can leave a line the formatter then lays out.
"$bin/ruff" check --fix --exit-zero --quiet .
"$bin/ruff" format .
"$bin/clang-format" -i "${cxx[@]}"
echo "--> left to fix by hand: ruff's findings without a safe fix, then mypy's errors"
status=0
"$bin/ruff" check --output-format concise . || status=1
"$bin/mypy" || status=1
exit $status
