"""Rows no sequence uses, set to 0 in packed buffers at the cost of those rows, not of the whole buffer.

Kernels that work in whole tiles (FlashAttention-3) read rows past a sequence's used end and leave rows they
do not own unwritten. Their inputs' unused rows must therefore hold no NaN (P = 0 there, but 0 * NaN = NaN),
and their outputs' unwritten rows must read 0. A `jnp.where` over each tensor does both, at one full read and
write per tensor (W1: about 0.3 ms a forward + backward). On a GPU the extension's zero-rows handler
(ffi/zero_rows.cc) does it in place instead: one thread per row decides ownership and only unowned rows are
written. A buffer that is still needed elsewhere (a jit argument, say) is copied by XLA first, which costs
what the `where` did; an intermediate (a projection's output, a kernel's result) is zeroed where it lies.

    cu_seqlens [0, 3, 5], lengths [2, 2], T = 7: rows 2, 5 and 6 are zeroed (row 2 is past sequence 0's used
    end, rows 5 and 6 are capacity padding); rows 0, 1, 3 and 4 are untouched.

Elsewhere (the CPU, where the FA3 stand-in runs in tests; a GPU where the kernel cannot load) the `where`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.index import row_positions


def _kernel_target(buffers) -> str | None:
    if any((x.size // max(x.shape[0], 1)) * x.dtype.itemsize % 4 for x in buffers):  # the kernel writes 4-byte words
        return None
    return extension.own_kernel_target("zero_rows")


def zero_unused_rows(buffers: tuple, starts: jax.Array, lengths: jax.Array, gate: jax.Array | None = None) -> tuple:
    """`buffers` (each [T, ...], rows along the leading axis; T may differ between them) with every row outside
    [starts[b], starts[b] + lengths[b]) set to 0, and every row of a sequence whose gate is 0. starts:
    sanitised int32 cu_seqlens [B + 1]; lengths: the rows each sequence uses, int32 [B], at most its slot
    (index.sequence_lengths). On a GPU one kernel launch serves up to four buffers (ffi/own_kernels.cu)."""
    buffers = tuple(buffers)
    if not buffers:
        return buffers
    gate = jnp.ones_like(lengths) if gate is None else gate.astype(jnp.int32)
    target = _kernel_target(buffers)
    if target is None:
        return tuple(
            jnp.where(
                _used_rows(starts, lengths, gate, x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1)),
                x,
                jnp.zeros((), x.dtype),
            )
            for x in buffers
        )
    types = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in buffers)
    call = jax.ffi.ffi_call(
        target, types, vmap_method="sequential", input_output_aliases={3 + i: i for i in range(len(buffers))}
    )
    return tuple(call(starts, lengths, gate, *buffers))


def _used_rows(starts, lengths, gate, rows: int) -> jax.Array:
    """[rows] bool: the row lies in a sequence's used rows and that sequence's gate is open."""
    # row_positions with max_seqlen = rows and seqused = lengths marks exactly the rows the lengths use.
    sequence, _, valid = row_positions(jnp.minimum(starts, rows), rows, rows, lengths)
    return valid & (gate[jnp.minimum(sequence, lengths.shape[0] - 1)] > 0)
