#!/usr/bin/env bash
# On a GPU host (the offline H200: ../shared/gpu-host/README.md): installs a prebuilt wheel - nothing is
# compiled - beside the host's jax and CUDA plugin, and runs every GPU test and the self-check from that
# install, outside the source tree. The wheel comes from scripts/check_wheel.sh on any Linux machine.
#
#   bash benchmarks/gpu_wheel_check.sh                  # the newest dist/*-cp312-abi3-manylinux*.whl
#   bash benchmarks/gpu_wheel_check.sh path/to/wheel.whl
#   PYTEST_ARGS="-n 8" bash benchmarks/gpu_wheel_check.sh   # the GPU tests on 8 workers (pytest-xdist)
set -euo pipefail
cd "$(dirname "$0")/.."
wheel=${1:-$(ls -t dist/*-cp312-abi3-manylinux*.whl | head -n 1)}
site=$(mktemp -d)
run=$(mktemp -d)
trap 'rm -rf "$site" "$run"' EXIT
echo "==> $(python3 --version), installing $(basename "$wheel") with --no-deps into $site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
cp -r tests "$run/"
cp pyproject.toml "$run/"  # pytest's settings only
cd "$run"
export PYTHONPATH=$site
# An editable install of the source tree (benchmarks/gpu_run.sh makes one) must not stand in for the wheel.
python3 -c "
import jax, jax_ragged_attn, jax_ragged_attn._ext as ext
for f in (jax_ragged_attn.__file__, ext.__file__):
    assert f.startswith('$site/'), f'{f} is not from the wheel'
    print('    imported', f)
print('    jax', jax.__version__, 'on', jax.devices())"
python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not soak" ${PYTEST_ARGS:-} tests --ignore=tests/test_load.py
python3 -m jax_ragged_attn.tools.selfcheck
