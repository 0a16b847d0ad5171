"""Calls whose tensors pass 2**31 elements run on the GPU kernels, not the xla fallback (H200; skipped
elsewhere, with the reason). Marked `soak`: each case holds tens of GB, so it runs alone, not beside the
GPU suite's parallel workers: `pytest -m soak tests/test_large_tensors.py`.

The check: sequences never interact, so the op over a whole packed buffer must give, row for row, what it
gives over the buffer's first and second halves of sequences called separately (each half is below 2**31
and runs unsplit). cuDNN serves the whole call over head groups (backends/shared/head_groups.py); a NaN in the
padding rows (inputs and cotangent) must not reach any result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ragged_attn as jra
from jax_ragged_attn.backends.cudnn import extents
from jax_ragged_attn.backends.fa3 import ragged as fa3
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.testing import tolerance

_REASON = extension.cudnn_unavailable_reason()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.soak,
    pytest.mark.skipif(_REASON is not None, reason=f"cuDNN path unavailable: {_REASON}"),
]

PADDING = 64  # NaN rows after the last sequence


@functools.partial(jax.jit, static_argnums=(2,))
def _relative_error(actual, expected, finite_only=False):
    """max |actual - expected| / max(|expected|, 1), reduced on the device (no float32 copy of 4 GB arrays);
    NaN where actual holds a NaN that expected does not."""
    a, e = actual.astype(jnp.float32), expected.astype(jnp.float32)
    nan_leak = jnp.any(jnp.isnan(a) & ~jnp.isnan(e))
    error = jnp.max(jnp.where(jnp.isfinite(e), jnp.abs(a - e), 0.0)) / jnp.maximum(
        jnp.max(jnp.abs(jnp.where(jnp.isfinite(e), e, 0.0))), 1.0
    )
    return jnp.where(nan_leak, jnp.nan, error)


def _buffers(key, rows, heads, dim, real):
    x = jax.random.normal(key, (rows, heads, dim), jnp.bfloat16)
    return jnp.where((jnp.arange(rows) < real)[:, None, None], x, jnp.nan)


def _run(q, k, v, d_out, cu_q, cu_kv, max_q, max_kv, implementation):
    attend = functools.partial(
        jra.ragged_attention,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        is_causal=True,
        diagonal_alignment="bottom_right",
        return_stats=True,
        implementation=implementation,
    )
    # The stats as aux: no cotangent reaches them, so the plain backward runs.
    out, vjp, stats = jax.vjp(lambda q, k, v: attend(q, k, v, cu_q, cu_kv), q, k, v, has_aux=True)
    return (out, stats, *vjp(d_out))


def _check_against_halves(lengths_q, lengths_kv, heads_q, heads_kv, implementation, *, min_groups):
    dim = 128
    cu_q, cu_kv = np.concatenate([[0], np.cumsum(lengths_q)]), np.concatenate([[0], np.cumsum(lengths_kv)])
    rows_q, rows_kv = int(cu_q[-1]) + PADDING, int(cu_kv[-1]) + PADDING
    keys = jax.random.split(jax.random.key(len(lengths_q)), 4)
    q = _buffers(keys[0], rows_q, heads_q, dim, cu_q[-1])
    k = _buffers(keys[1], rows_kv, heads_kv, dim, cu_kv[-1])
    v = _buffers(keys[2], rows_kv, heads_kv, dim, cu_kv[-1])
    d_out = _buffers(keys[3], rows_q, heads_q, dim, cu_q[-1])
    max_q, max_kv = int(max(lengths_q)), int(max(lengths_kv))
    config = make_config(
        q,
        k,
        v,
        jnp.asarray(cu_q, jnp.int32),
        jnp.asarray(cu_kv, jnp.int32),
        AttentionOptions(is_causal=True),
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
    )
    assert extents.groups(config) >= min_groups

    whole = _run(
        q, k, v, d_out, jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_kv, jnp.int32), max_q, max_kv, implementation
    )
    atol, _ = tolerance("bfloat16")
    half = len(lengths_q) // 2
    names = ("out", "stats", "dq", "dk", "dv")
    for first, last in ((0, half), (half, len(lengths_q))):
        (q0, q1), (k0, k1) = (int(cu_q[first]), int(cu_q[last])), (int(cu_kv[first]), int(cu_kv[last]))
        part = _run(
            q[q0:q1],
            k[k0:k1],
            v[k0:k1],
            d_out[q0:q1],
            jnp.asarray(cu_q[first : last + 1] - q0, jnp.int32),
            jnp.asarray(cu_kv[first : last + 1] - k0, jnp.int32),
            max_q,
            max_kv,
            implementation,
        )
        rows = {"out": (q0, q1), "stats": (q0, q1), "dq": (q0, q1), "dk": (k0, k1), "dv": (k0, k1)}
        for name, got, expected in zip(names, whole, part):
            start, stop = rows[name]
            got = got[:, start:stop] if name == "stats" else got[start:stop]  # stats head-major [H, T]
            error = float(_relative_error(got, expected))
            assert error <= atol, f"{implementation}: {name} of sequences {first}..{last - 1}: error {error}"
        del part
    # Padding: out and gradients 0 there, whatever NaN the inputs and the cotangent hold.
    for name, result in zip(names, whole):
        tail = result[:, -PADDING:] if name == "stats" else result[-PADDING:]
        if name != "stats":
            assert float(jnp.max(jnp.abs(tail.astype(jnp.float32)))) == 0.0, f"{name}: padding rows not 0"


def test_packed_mha_past_two_to_the_31_on_cudnn():
    # 65 x 4,096 tokens x 64 heads x 128: q, k, v, out each 2.18e9 elements (2**31 = 2.15e9).
    lengths = [4096] * 65
    assert 65 * 4096 * 64 * 128 > 2**31
    _check_against_halves(lengths, lengths, 64, 64, "cudnn", min_groups=2)


@pytest.mark.skipif(fa3.unavailable_reason() is not None, reason=f"FA3: {fa3.unavailable_reason()}")
def test_packed_mha_past_two_to_the_31_on_fa3():
    lengths = [4096] * 65
    _check_against_halves(lengths, lengths, 64, 64, "fa3", min_groups=1)


def test_one_query_per_sequence_against_a_large_gqa_cache_on_cudnn():
    # The serving decode shape (256 x 2,048 rows, GQA 32/8) made larger: 288 sequences, so K and V (6.0e8
    # elements) fit unsplit but the backward's per-query-head dK/dV (2.4e9) does not.
    _check_against_halves([1] * 288, [2048] * 288, 32, 8, "cudnn", min_groups=2)
