"""Loads the compiled extension, registers its FFI targets and answers "can the cuDNN path run here?".

Importing jax_ragged_attn never fails because of the extension: a missing build or a machine without a GPU
only makes `cudnn_unavailable_reason()` return a sentence, and implementation=None picks the xla path.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import os

import jax


@functools.cache
def _module():
    """The nanobind module, or the ImportError that explains why there is none."""
    try:
        from jax_ragged_attn import _ext
    except ImportError as error:
        return error
    return _ext


def unimportable_reason(error: ImportError) -> str:
    """Why the extension does not import, in a sentence. Without a built module Python's own text is about a
    circular import (`from jax_ragged_attn import _ext` inside the package's import), so that case is named."""
    if importlib.util.find_spec("jax_ragged_attn._ext") is None:
        return (
            "the C++ extension is not built in this install (no jax_ragged_attn/_ext module; docs/INSTALL.md, "
            '"Building", says how to build it)'
        )
    return f"the C++ extension is built but does not import: {error}"


def module():
    """The extension module; raises NotImplementedError when it was not built."""
    ext = _module()
    if isinstance(ext, ImportError):
        raise NotImplementedError(unimportable_reason(ext))
    return ext


# The names ffi/module.cc's table gives its FFI targets, by role: what HLO tools look for where the extension is
# not importable (nothing can call a target then).
_TARGET_NAMES = {
    "forward": "jax_ragged_attn_forward",
    "backward": "jax_ragged_attn_backward",
    "paged_forward": "jax_ragged_attn_paged_forward",
    "zero_rows": "jax_ragged_attn_zero_rows",
    "clamp_cache_index": "jax_ragged_attn_clamp_cache_index",
}


def targets() -> dict[str, str]:
    """{role: name} of every FFI target the extension registers (ffi/module.cc's table): the ragged attention's
    "forward" and "backward" (check mode and the packed layouts are the same two handlers, ffi/handlers.cc),
    the KV-cache op's "paged_forward", and our own kernels' "zero_rows" and "clamp_cache_index"."""
    ext = _module()
    if isinstance(ext, ImportError):
        return dict(_TARGET_NAMES)
    return dict(ext.targets())


# The target names, for callers that want constants (the table's names where a stale build lacks one).
_NAMES = {**_TARGET_NAMES, **targets()}
FORWARD_TARGET = _NAMES["forward"]
BACKWARD_TARGET = _NAMES["backward"]
PAGED_FORWARD_TARGET = _NAMES["paged_forward"]


@functools.cache
def config_fields() -> tuple[tuple[str, str], ...]:
    """The configuration's fields as the extension declares them (ffi/attention_config.h), in order:
    (name, attribute type "int64" or "float32")."""
    return tuple((name, kind) for name, kind in module().config_fields())


def _wheel_cudnn_path() -> str:
    """libcudnn.so.9 inside the nvidia-cudnn wheel, for when jaxlib has not loaded one yet."""
    spec = importlib.util.find_spec("nvidia.cudnn") if importlib.util.find_spec("nvidia") else None
    for base in (spec.submodule_search_locations or []) if spec else []:
        for path in glob.glob(os.path.join(base, "lib", "libcudnn.so.9*")):
            return path
    return ""


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("gpu")) and jax.devices("gpu")[0].platform == "gpu"
    except RuntimeError:
        return False


@functools.cache
def _initialize() -> str | None:
    """Registers the FFI targets and loads cuDNN once; returns why the cuDNN path is unusable, or None."""
    ext = _module()
    if isinstance(ext, ImportError):
        return unimportable_reason(ext)
    if not _has_cuda_backend():
        return f"no CUDA device: JAX's backend is {jax.default_backend()!r}"
    # The attention handlers' FFI state (ffi/pinned_graphs.h) is a type XLA must know before their targets.
    for name, registration in ext.state_type_registrations().items():
        jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    for name, handler in ext.registrations().items():  # a capsule, or a dict of FFI stages
        jax.ffi.register_ffi_target(name, handler, platform="CUDA")
    try:
        ext.load_cudnn(_wheel_cudnn_path())
    except RuntimeError as error:
        return str(error)
    if ext.cudnn_version() < 90600:
        return f"cuDNN {ext.cudnn_version()} is too old: ragged backward needs 9.6 or newer"
    return None


def cudnn_unavailable_reason() -> str | None:
    """None when the cuDNN path can run in this process, else a sentence saying why not. The first time it can,
    a KnownIssueWarning names the features the loaded versions' known bugs fence off (known_issues.py)."""
    reason = _initialize()
    if reason is None:
        from jax_ragged_attn.backends.shared import known_issues  # here, not at import: `import` stays cheap

        known_issues.warn_once()
    return reason


def own_kernel_target(role: str) -> str | None:
    """The FFI target of `role` ("zero_rows", "clamp_cache_index"), when JAX runs on a GPU and our own kernels
    (ffi/own_kernels.cu's PTX) can run there, else None: the caller then computes the same with jnp."""
    if jax.default_backend() != "gpu":
        return None
    return _own_kernel_target(role, device_ordinal())


@functools.cache
def _own_kernel_target(role: str, device: int) -> str | None:
    if cudnn_unavailable_reason() is not None:  # also registers the extension's targets
        return None
    ext = module()
    if ext.prepare_own_kernels(device) != "":
        return None
    return targets().get(role)


def versions() -> dict:
    """What the self-check prints: extension, cuDNN and cudnn-frontend versions."""
    ext = _module()
    if isinstance(ext, ImportError):
        return {"extension": unimportable_reason(ext)}
    reason = cudnn_unavailable_reason()
    return {
        "extension": "built",
        "cudnn_frontend": ".".join(map(str, ext.frontend_version)),
        "cudnn": ext.cudnn_version() or "not loaded",
        # The frontend's newer paths need both these headers and the loaded library (ffi/module.cc).
        "cudnn_headers": ext.cudnn_header_version,
        "cudnn_path": "usable" if reason is None else f"unusable: {reason}",
    }


def device_ordinal() -> int:
    # The device whose graph answers trace-time questions (workspace size, support): the first GPU. 0 where
    # there is none: the extension then answers that it cannot build (unsupported_reason says why first).
    try:
        return jax.devices("gpu")[0].local_hardware_id or 0
    except RuntimeError:
        return 0
