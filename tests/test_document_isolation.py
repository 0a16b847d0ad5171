"""A non-finite value in one document reaches that document only: never another document's outputs or
gradients, never the padding rows (which read exactly 0), on every implementation that runs here.

Each case plants NaN or inf in one real row of document 1's q, k, v or output cotangent, runs the forward and
the backward, and compares every row outside document 1 with the same call on the clean inputs: bit for bit,
since those rows' arithmetic is the same. Document 1 itself must show the value somewhere (loud, not hidden).
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from implementations import xla_and_cudnn

import jax_ragged_attn as jra
from jax_ragged_attn.index import cu_seqlens_from_lengths

LENGTHS = (13, 21, 9)  # document 1 (rows 13..33) gets the planted value
CAPACITY, HEADS_Q, HEADS_KV, DIM = 48, 4, 2, 64
DOC = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])


def _call(implementation, q, k, v, d_out, cu, is_causal):
    def f(q, k, v):
        return jra.ragged_attention(
            q, k, v, cu, cu, max_seqlen_q=32, max_seqlen_kv=32, is_causal=is_causal, implementation=implementation
        )

    out, pullback = jax.vjp(f, q, k, v)
    return (out, *pullback(d_out))


@pytest.mark.parametrize("implementation", xla_and_cudnn())
# The fast tier plants NaN under a causal mask; inf and the full mask take the same paths (slow tier).
@pytest.mark.parametrize(
    "is_causal", [pytest.param(False, id="full", marks=pytest.mark.slow), pytest.param(True, id="causal")]
)
@pytest.mark.parametrize(
    "value", [pytest.param(np.nan, id="nan"), pytest.param(np.inf, id="inf", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("where", ["q", "k", "v", "d_out"])
def test_a_non_finite_value_stays_in_its_document(implementation, is_causal, value, where):
    rng = np.random.default_rng(zlib.crc32(f"{where} {value} {is_causal}".encode()))
    shapes = {
        "q": (CAPACITY, HEADS_Q, DIM),
        "k": (CAPACITY, HEADS_KV, DIM),
        "v": (CAPACITY, HEADS_KV, DIM),
        "d_out": (CAPACITY, HEADS_Q, DIM),
    }
    clean = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    for x in clean.values():
        x[sum(LENGTHS) :] = np.nan  # padding rows, never read
    planted = dict(clean)
    planted[where] = clean[where].copy()
    planted[where][DOC.start + 5, 1, 7] = value  # one real row of document 1, mid-document
    cu = jnp.asarray(cu_seqlens_from_lengths(np.array(LENGTHS)))
    dtype = jnp.bfloat16 if implementation != "xla" else jnp.float32
    run = jax.jit(lambda *a: _call(implementation, *a, cu, is_causal))
    want = [np.asarray(x, np.float32) for x in run(*(jnp.asarray(clean[n], dtype) for n in shapes))]
    got = [np.asarray(x, np.float32) for x in run(*(jnp.asarray(planted[n], dtype) for n in shapes))]

    others = np.ones(CAPACITY, bool)
    others[DOC] = False
    for name, g, w in zip(("out", "d_q", "d_k", "d_v"), got, want):
        np.testing.assert_array_equal(g[others], w[others], err_msg=f"{name}: rows outside document 1 changed")
        assert np.all(g[sum(LENGTHS) :] == 0), f"{name}: padding rows are not exactly 0"
    touched = [name for name, g in zip(("out", "d_q", "d_k", "d_v"), got) if not np.all(np.isfinite(g[DOC]))]
    assert touched, f"the {value} planted in {where} vanished: document 1's results are all finite"
