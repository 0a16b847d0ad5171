"""jax.export of steps that call this package's ops: `export` and `deserialize`, jax.export's two calls with
what this package's custom calls need added.

    exported = jax_ragged_attn.export.export(jax.jit(step))(*args)   # jax.export.export, our targets allowed
    blob = exported.serialize()
    step = jax_ragged_attn.export.deserialize(blob)                  # in a fresh process: our handlers
    step.call(*args)                                                 # registered, then jax.export.deserialize

The xla path is plain JAX; the cuDNN and FA3 paths are FFI custom calls, which jax.export refuses unless told
that their targets are not covered by its compatibility guarantees (`disabled_checks`), and which a process
runs only once their handlers are registered there (`register`; the ops do it at trace time, and a
deserialized step is never traced). Through another library's exporter, pass `disabled_checks()` and call
`register()` before the step first runs. docs/API.md, "Exporting (jax.export)", says what the serialized step
holds and where it runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax

from jax_ragged_attn.backends.shared import extension

# The flash-attn3-jax handlers the fa3 family calls (fa3/ragged.py, fa3/kvcache.py), under its prefix.
FLASH_ATTN3_JAX_KERNELS = ("flash_mha_fwd", "flash_mha_bwd")


def _targets() -> dict[str, Callable[[], str | None]]:
    """{target: the call that registers its handler in this process and returns None, or why it cannot run
    here} for every FFI target a step of this package may contain."""
    # Here, not at import: `import jax_ragged_attn` loads no kernel family (backends/__init__.py's registry).
    from jax_ragged_attn.backends.fa3 import dew
    from jax_ragged_attn.backends.fa3 import ragged as flash_attn3_jax

    providers = (
        (extension.cudnn_unavailable_reason, extension.targets().values()),
        (flash_attn3_jax.unavailable_reason, [flash_attn3_jax.TARGET_PREFIX + n for n in FLASH_ATTN3_JAX_KERNELS]),
        (dew.unavailable_reason, [dew.TARGET_PREFIX + n for n in dew.TARGETS]),
    )
    targets: dict[str, Callable[[], str | None]] = {}
    for unavailable, names in providers:
        targets.update(dict.fromkeys(names, unavailable))
    return targets


def target_names() -> tuple[str, ...]:
    """Every FFI custom-call target a step of this package may contain: the extension's (cuDNN, our own
    kernels) and the FA3 providers' handlers as this package registers them."""
    return tuple(_targets())


def _allowed() -> list[jax.export.DisabledSafetyCheck]:
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in target_names()]


def disabled_checks() -> list[jax.export.DisabledSafetyCheck]:
    """jax.export.export's `disabled_checks` for every target of this package (target_names)."""
    return _allowed()


def export(
    fun_jit, *, platforms: Sequence[str] | None = None, disabled_checks: Sequence = ()
) -> Callable[..., jax.export.Exported]:
    """jax.export.export(fun_jit, platforms=..., disabled_checks=...) with this package's targets allowed
    besides the checks you disable."""
    return jax.export.export(fun_jit, platforms=platforms, disabled_checks=[*_allowed(), *disabled_checks])


def _reasons() -> dict[str, str | None]:
    """{target: None where its handler is registered here, else why it cannot run here}; registers each
    handler that can run (and loads cuDNN, and readies our own kernels on every GPU of this process)."""
    reasons = {name: unavailable() for name, unavailable in _targets().items()}
    if extension.cudnn_unavailable_reason() is None:
        # Readied here, not by the first call: loading the kernels' module is not allowed inside the CUDA-graph
        # capture XLA may record that call in (ffi/own_kernels.h).
        for device in jax.local_devices(backend="gpu"):
            extension.module().prepare_own_kernels(device.local_hardware_id or 0)
    return reasons


def register() -> None:
    """Registers every handler of this package that can run in this process (the extension's where it can
    run, the installed FA3 providers' on a Hopper GPU), so that a deserialized step that calls them runs.
    Idempotent. On a machine without a CUDA GPU there is nothing to register: the xla path has no custom
    calls."""
    _reasons()


def _called_targets(exported: jax.export.Exported) -> tuple[str, ...]:
    """This package's targets that `exported` calls, in order of first call."""
    called = re.findall(r"stablehlo\.custom_call @([\w.$-]+)\(", exported.mlir_module())
    ours = set(target_names())
    return tuple(dict.fromkeys(name for name in called if name in ours))


def deserialize(blob: bytes | bytearray) -> jax.export.Exported:
    """jax.export.deserialize(blob) after register(). Raises NotImplementedError, naming the target and the
    reason, where the step was exported for CUDA, JAX runs on a GPU here, and a handler it calls cannot run."""
    reasons = _reasons()
    exported = jax.export.deserialize(bytearray(blob))
    if "cuda" in exported.platforms and jax.default_backend() == "gpu":
        missing = {name: reasons[name] for name in _called_targets(exported) if reasons[name] is not None}
        if missing:
            raise NotImplementedError(
                f"the deserialized step ({exported.fun_name}) calls handlers that cannot run in this process: "
                + "; ".join(f"{name}: {reason}" for name, reason in missing.items())
            )
    return exported
