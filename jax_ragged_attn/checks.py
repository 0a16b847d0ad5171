"""Run-time validation of cu_seqlens for check=True (or JAX_RAGGED_ATTN_CHECK=1).

Without it, cu_seqlens are clamped monotone into the buffers (packing.sanitize_cu_seqlens): no kernel
addresses outside them, but a malformed batch silently becomes a different, valid one. With it, a
malformed batch stops the computation with an error naming the argument, the index and the values.

Mechanism: `jax.pure_callback` whose result *is* the checked cu_seqlens, copied back unchanged by a NumPy
function that raises ValueError on bad values. Why this one, measured on jax 0.10.2 (CPU):

- The attention consumes the callback's result, so it cannot start before the check has passed, and a
  raising callback aborts the XLA program (a later op that depends on it never runs). `jax.debug.callback`
  returns nothing to depend on: the kernels could run on the bad values while the check is still pending.
- It composes with jit, vmap (the check receives the batched [..., B + 1] array once), grad, custom_vjp,
  lax.scan and jax.checkpoint. `io_callback` carries an effect, which `jax.checkpoint` rejects ("Effects
  not supported in partial-eval of `checkpoint`/`remat`").
- `jax.experimental.checkify` (and jax's error_check) make the caller wrap the function and raise the
  error themselves; forgetting that would silently drop the check, the failure we are here to prevent.

What the user sees: an exception whose message is "INTERNAL: CpuCallback error calling callback:
Traceback ..." ending in "ValueError: cu_seqlens_q is invalid: ...", raised when the jitted call runs
(CPU) or, with asynchronous dispatch, at the latest when a result that depends on it is read. Its type
depends on jax's dispatch path: `jax.errors.JaxRuntimeError` (a RuntimeError) on a first call or eagerly,
ValueError when a compiled function is called again through jit's C++ fast path; catch both. jax also
logs the callback's traceback at ERROR level. A pure_callback whose result is unused is dead code and
is removed with it, so only cu_seqlens that reach a kernel are checked. On a GPU each check is one small
device-to-host round trip and a stream sync.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

ENV_VAR = "JAX_RAGGED_ATTN_CHECK"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def check_enabled(check: bool | None) -> bool:
    """An explicit check=True/False wins; None reads JAX_RAGGED_ATTN_CHECK (read at trace time).

    An unrecognised value raises rather than meaning "off": a typo must not silently disable the checks.
    """
    if check is not None:
        if not isinstance(check, (bool, np.bool_)):  # check="false" must not mean "on"
            raise ValueError(f"check must be True, False or None, got {check!r}")
        return bool(check)
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{ENV_VAR} must be one of {_TRUE + _FALSE[1:]} (or unset), got {os.environ[ENV_VAR]!r}")


def _problems(cu: np.ndarray, name: str, capacity: int, max_seqlen: int, bound: str) -> list[str]:
    """What is wrong with one [B + 1] cu_seqlens, first offending index of each kind."""
    problems = []
    if cu[0] != 0:
        problems.append(f"{name}[0] = {cu[0]}, must be 0")
    lengths = np.diff(cu)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        problems.append(f"it decreases at index {i + 1}: {name}[{i}] = {cu[i]} > {name}[{i + 1}] = {cu[i + 1]}")
    if (cu > capacity).any():
        i = int(np.argmax(cu > capacity))
        problems.append(f"{name}[{i}] = {cu[i]} is past the capacity {capacity} (rows of the packed buffer)")
    if (lengths > max_seqlen).any():
        i = int(np.argmax(lengths > max_seqlen))
        problems.append(f"sequence {i} has {lengths[i]} tokens ({name}[{i + 1}] - {name}[{i}] = {cu[i + 1]} - "
                        f"{cu[i]}), more than {bound} = {max_seqlen}")
    return problems


def _check_on_host(cu_seqlens, *, name: str, capacity: int, max_seqlen: int) -> np.ndarray:
    values = np.asarray(cu_seqlens)
    # Under vmap the callback receives [..., B + 1] at once; name the mapped element that is wrong.
    bound = name.replace("cu_seqlens", "max_seqlen") if "cu_seqlens" in name else "max_seqlen"
    for index in np.ndindex(values.shape[:-1]):
        problems = _problems(values[index].astype(np.int64), name, capacity, max_seqlen, bound)
        if problems:
            where = f" (vmapped element {index})" if index else ""
            got = np.array2string(values[index], threshold=32, max_line_width=10**6)
            raise ValueError(f"{name} is invalid{where}: " + "; ".join(problems) + f". Got {got}")
    return values


def checked_cu_seqlens(cu_seqlens: jax.Array, *, name: str, capacity: int, max_seqlen: int) -> jax.Array:
    """cu_seqlens, unchanged, once a host check has found it valid; otherwise the computation stops.

    Valid means: starts at 0, never decreases, never exceeds `capacity` (the packed buffer's rows) and no
    sequence is longer than `max_seqlen`. Works eagerly and under jit, vmap, grad and checkpoint.
    """
    check = functools.partial(_check_on_host, name=name, capacity=int(capacity), max_seqlen=int(max_seqlen))
    result = jax.ShapeDtypeStruct(cu_seqlens.shape, cu_seqlens.dtype)
    return jax.pure_callback(check, result, cu_seqlens, vmap_method="expand_dims")


# Guard mode of the cuDNN path (on with check=True): GUARD_BYTES past the end of the workspace the graph
# reported, and GUARD_ROWS rows before and after every output, filled with CANARY bytes before the call
# and verified after it.
GUARD_BYTES = 4096
GUARD_ROWS = 8
CANARY = 0xA5
_UINTS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _count_clobbered(band, *, description: str) -> np.ndarray:
    band = np.asarray(band)
    clobbered = int(np.count_nonzero(band != CANARY))
    if clobbered:
        raise RuntimeError(
            f"cuDNN wrote past the workspace it reported: {clobbered} of the {band.shape[-1]} guard bytes after "
            f"it were overwritten [{description}]"
        )
    return np.zeros(band.shape[:-1], np.int32)


def verified_guard_band(band: jax.Array, *, description: str) -> jax.Array:
    """A zero int32 once a host check found every byte of `band` still CANARY; otherwise the computation stops."""
    check = functools.partial(_count_clobbered, description=description)
    result = jax.ShapeDtypeStruct(band.shape[:-1], np.int32)
    return jax.pure_callback(check, result, band, vmap_method="expand_dims")


def padded_rows(x: jax.Array, axis: int, rows: int) -> jax.Array:
    """`x` with `rows` NaN rows before and after along `axis`: the input side of an output's guard band,
    so the kernel's buffers agree in shape; a kernel reading one of them would spread NaN."""
    widths = [(0, 0)] * x.ndim
    widths[axis] = (rows, rows)
    return jnp.pad(x, widths, constant_values=jnp.nan)


def canary_array(shape, dtype) -> jax.Array:
    """An array of `dtype` whose every byte is CANARY (for a float, a finite value nothing computes)."""
    dtype = jnp.dtype(dtype)
    word = int.from_bytes(bytes([CANARY]) * dtype.itemsize, "little")
    return jax.lax.bitcast_convert_type(jnp.full(shape, word, _UINTS[dtype.itemsize]), dtype)


def _count_changed(band, *, name: str, rows: int, description: str) -> np.ndarray:
    band = np.asarray(band)
    changed = int(np.count_nonzero(band != int.from_bytes(bytes([CANARY]) * band.dtype.itemsize, "little")))
    if changed:
        raise RuntimeError(
            f"cuDNN wrote outside the rows of {name}: {changed} of the {band.size} elements in the {rows} guard "
            f"rows before and after it were overwritten [{description}]"
        )
    return np.zeros((), np.int32)


def verified_output_band(result: jax.Array, axis: int, rows: int, *, name: str, description: str) -> jax.Array:
    """A zero int32 once a host check found the `rows` guard rows at both ends of `result` along `axis`
    still canary; otherwise the computation stops with an error naming `name`."""
    size = result.shape[axis]
    before = jax.lax.slice_in_dim(result, 0, rows, axis=axis)
    after = jax.lax.slice_in_dim(result, size - rows, size, axis=axis)
    band = jnp.concatenate([before, after], axis=axis)
    band = jax.lax.bitcast_convert_type(band, _UINTS[jnp.dtype(result.dtype).itemsize])
    check = functools.partial(_count_changed, name=name, rows=rows, description=description)
    return jax.pure_callback(check, jax.ShapeDtypeStruct((), np.int32), band, vmap_method="sequential")
