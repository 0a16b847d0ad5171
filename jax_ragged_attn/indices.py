"""Index arrays (cu_seqlens, seqused, positions, segment ids) of any integer dtype, made int32 once.

Users build them the ordinary way - `jnp.array([0, 3, 7])`, NumPy's int64 `np.cumsum`, a data loader's
uint32 - and under `jax_enable_x64` the first is int64 too. The kernels and the graphs take int32, so every
entry point passes its index arrays through `as_int32` first thing:

- int32 passes through untouched (no op added to the program);
- NumPy (host) arrays of another integer dtype are converted at trace time, and a value outside int32 is a
  ValueError naming the argument and the first such entry (it would be a different value after the cast);
- device arrays and tracers of another integer dtype are clipped into int32's range, then cast: a value
  that does not fit becomes int32's min or max, which every consumer already treats as out of range
  (cu_seqlens are clamped into the buffer and counted by return_overflow, check mode raises naming the
  argument; a segment id above the range stays a positive id), never a wrapped-around small value;
- anything else (floats, bools, non-arrays) is a ValueError naming the argument.

Python lists and tuples of ints are accepted as NumPy arrays would be.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_INT32 = np.iinfo(np.int32)


def as_int32(x, name: str):
    """`x` as int32 (a NumPy array stays a NumPy array, a jax value a jax value); see the module docstring."""
    if isinstance(x, (list, tuple)):
        try:
            x = np.asarray(x)
        except ValueError:
            raise ValueError(f"{name} must be an integer array, got a ragged {type(x).__name__}") from None
    dtype = getattr(x, "dtype", None)
    if dtype is None or getattr(x, "shape", None) is None:
        raise ValueError(f"{name} must be an integer array, got {type(x).__name__}")
    if dtype == np.int32:
        return x
    if not np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        raise ValueError(f"{name} must have an integer dtype (any width; it is converted to int32), got {dtype}")
    if isinstance(x, np.ndarray):
        outside = (x < _INT32.min) | (x > _INT32.max)
        if outside.any():
            at = tuple(int(i) for i in np.argwhere(outside)[0])
            where = at[0] if len(at) == 1 else at
            raise ValueError(f"{name}[{where}] = {x[at]} does not fit int32 (the kernels' index type); "
                             f"{name} must hold values in [{_INT32.min}, {_INT32.max}]")
        return x.astype(np.int32)
    return _clip_to_int32(x)


def _clip_to_int32(x):
    info = jnp.iinfo(x.dtype)
    if info.min >= _INT32.min and info.max <= _INT32.max:  # int8/16, uint8/16: every value fits
        return x.astype(jnp.int32)
    # Clip in x's own dtype (its bounds expressed in it), so no value wraps before the cast.
    low = np.array(max(info.min, _INT32.min), x.dtype)
    high = np.array(min(info.max, _INT32.max), x.dtype)
    return jax.lax.clamp(low, x, high).astype(jnp.int32)
