#!/usr/bin/env bash
# Creates the virtual environment .venv (or $VENV) and installs jax_ragged_attn into it, editable, with
# everything its build reads and its tests need. Safe to run again: it only adds what is missing.
#
# The extension builds from pip packages alone (no CUDA toolkit, no GPU): jax for the XLA FFI headers,
# nvidia-cudnn-frontend for the graph API (header-only for us, hence --no-deps: its Python package pulls
# a large CUTLASS DSL we do not use), nvidia-cudnn-cu13 for cudnn.h and the CUDA runtime/CRT/CCCL wheels.
# With an NVIDIA driver present it installs jax[cuda13], which brings the cuDNN it loads at run time.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  jax='jax[cuda13]'
else
  jax='jax'
fi
"$py" -m pip install -q "$jax" numpy scikit-build-core nanobind cmake ninja pytest pytest-xdist absl-py hypothesis flax optax matplotlib tqdm
# For their headers only: --no-deps keeps cuBLAS and the CUTLASS DSL (dependencies of these packages) off a
# CPU machine; on a GPU machine jax[cuda13] has already installed the libraries they belong to. CUDA 13
# headers (<14): CUDA 14 wheels install under nvidia/cu14, which ffi/find_headers.py does not search.
"$py" -m pip install -q --no-deps 'nvidia-cudnn-frontend>=1.28' 'nvidia-cudnn-cu13<10' 'nvidia-cuda-runtime<14' \
  'nvidia-cuda-crt<14' 'nvidia-cuda-cccl<14' 'nvidia-cuda-nvrtc<14'
"$py" -m pip install -q --no-build-isolation --no-deps -e .
