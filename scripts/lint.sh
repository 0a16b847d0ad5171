#!/usr/bin/env bash
# The style and type checks CI runs (.ci/run): ruff's lint and its format check over the Python, clang-format
# over the C++ of ffi/ and tests/native/, mypy over the op and backend layers. pyproject.toml's [tool.ruff] and
# [tool.mypy] and .clang-format configure them; pyproject.toml's `lint` extra pins their versions. It changes
# no file (scripts/format.sh applies the fixes and the formatting) and runs every check before it fails.
#
#   bash scripts/lint.sh              # the tools installed in .venv (PYTHON=path/to/python for another one)
#   bash scripts/lint.sh --install    # first installs the pinned tools into that environment
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || { echo "no Python at $py: run scripts/install.sh or set PYTHON" >&2; exit 1; }
bin=$(dirname "$py")
if [ "${1:-}" = --install ]; then
  mapfile -t pins < <("$py" -c 'import tomllib
print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["lint"], sep="\n")')
  "$py" -m pip install -q "${pins[@]}"
fi
shopt -s nullglob
cxx=(ffi/*.cc ffi/*.h ffi/*.cu tests/native/*.cc tests/native/*.h)
failed=()
check() {  # check NAME COMMAND...
  echo "--> $1"
  "${@:2}" || failed+=("$1")
}
check "ruff check" "$bin/ruff" check .
check "ruff format" "$bin/ruff" format --check .
check clang-format "$bin/clang-format" --dry-run -Werror "${cxx[@]}"
check mypy "$bin/mypy"
if [ ${#failed[@]} -gt 0 ]; then
  printf -v names '%s, ' "${failed[@]}"
  echo "lint: ${names%, } failed (scripts/format.sh applies ruff's safe fixes and both formatters)" >&2
  exit 1
fi
echo "lint: ruff, ruff format, clang-format and mypy pass"
