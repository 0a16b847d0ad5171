"""Prints the include directories the extension needs, one `NAME=path` a line.

Run by CMakeLists.txt (and third_party/bazel/pip_paths.bzl) with the Python it builds for. Every header comes
from a pip package of that environment - under `pip install .` the ones pyproject.toml's [build-system]
requires - except cudnn-frontend's, which are vendored in third_party/cudnn_frontend/ (see its VERSION).
A header that cannot be found ends the build with one sentence naming the package that provides it.
"""

import importlib.metadata
import importlib.util
import os
import sys

VENDORED_FRONTEND = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "third_party", "cudnn_frontend", "include"
)


def _package_dir(module: str) -> str | None:
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def xla_ffi() -> str | None:
    # What jax.ffi.include_dir() returns (jaxlib/include), found without importing jax: the build environment
    # needs jaxlib only.
    base = _package_dir("jaxlib")
    path = base and os.path.join(base, "include")
    return path if path and os.path.exists(os.path.join(path, "xla", "ffi", "api", "ffi.h")) else None


def cudnn_frontend() -> str | None:
    # An nvidia-cudnn-frontend wheel installed in the build environment wins over the vendored copy: it is what
    # the user chose (scripts/build_old_frontend.sh builds against 1.27 that way). Under `pip install .` the
    # isolated build environment has none, so the vendored headers are used.
    try:
        dist = importlib.metadata.distribution("nvidia-cudnn-frontend")
    except importlib.metadata.PackageNotFoundError:
        dist = None
    for path in ([str(dist.locate_file("include"))] if dist else []) + [VENDORED_FRONTEND]:
        if os.path.exists(os.path.join(path, "cudnn_frontend.h")):
            return path
    return None


def cudnn() -> str | None:
    base = _package_dir("nvidia.cudnn")
    path = base and os.path.join(base, "include")
    return path if path and os.path.exists(os.path.join(path, "cudnn.h")) else None


def cuda_runtime() -> str | None:
    # cudnn.h pulls in cuda_runtime_api.h, which needs crt/ (nvidia-cuda-crt) and cuda_fp16.h, which needs
    # CCCL's nv/target (nvidia-cuda-cccl); cudnn-frontend includes nvrtc.h (nvidia-cuda-nvrtc): take the first
    # directory that has all four. CUDA 13 wheels install under nvidia/cu13, CUDA 12 ones under
    # nvidia/cuda_runtime; a toolkit has everything in one place.
    candidates = []
    for module in ("nvidia.cu13", "nvidia.cuda_runtime"):
        base = _package_dir(module)
        if base:
            candidates.append(os.path.join(base, "include"))
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "include"))
    needed = ("cuda_runtime_api.h", os.path.join("crt", "host_defines.h"), os.path.join("nv", "target"), "nvrtc.h")
    for path in candidates:
        if all(os.path.exists(os.path.join(path, name)) for name in needed):
            return path
    return None


def main() -> int:
    found = {
        "XLA_FFI_INCLUDE_DIR": (xla_ffi, "jaxlib (pip install jaxlib)"),
        "CUDNN_FRONTEND_INCLUDE_DIR": (
            cudnn_frontend,
            f"nvidia-cudnn-frontend (the vendored copy {VENDORED_FRONTEND} is missing: use a full checkout, or "
            "pip install --no-deps 'nvidia-cudnn-frontend>=1.28')",
        ),
        "CUDNN_INCLUDE_DIR": (cudnn, "nvidia-cudnn-cu13 (pip install --no-deps 'nvidia-cudnn-cu13<10')"),
        "CUDA_INCLUDE_DIR": (
            cuda_runtime,
            "nvidia-cuda-runtime, nvidia-cuda-crt, nvidia-cuda-cccl and nvidia-cuda-nvrtc (pip install --no-deps "
            "'nvidia-cuda-runtime<14' 'nvidia-cuda-crt<14' 'nvidia-cuda-cccl<14' 'nvidia-cuda-nvrtc<14') or a CUDA "
            "toolkit",
        ),
    }
    for name, (locate, package) in found.items():
        path = locate()
        if not path:
            print(
                f"the headers for {name} were not found: install {package} into {sys.executable}'s environment",
                file=sys.stderr,
            )
            return 1
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
