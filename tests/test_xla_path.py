"""What only the xla path does: how implementation=None and "cudnn" behave where cuDNN cannot run.

The op's semantics (masks, empty sequences, padding, gradients, stats, determinism, jit / vmap / checkpoint)
are tested once for every implementation in test_semantics.py; its XlaTest runs them on this path.
"""

from __future__ import annotations

import functools
import zlib

import jax
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing import packed_batch


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded by the test's own id: fresh inputs per test, the same ones on every rerun."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _batch(rng, dtype):
    # GQA with an empty sequence and capacity padding; head dims that are multiples of 8, so that with
    # bfloat16 the only obstacle left for cuDNN is the missing GPU.
    return packed_batch(
        rng,
        (5, 0, 7),
        (6, 3, 2),
        num_heads_q=6,
        num_heads_kv=2,
        head_dim_qk=16,
        head_dim_v=8,
        dtype=dtype,
        slack_q=3,
        slack_kv=2,
    )


def test_default_implementation_on_cpu_is_xla(rng):
    if jax.default_backend() != "cpu":
        pytest.skip(
            f"implementation=None picks cuDNN when it can; this checks the CPU fallback, backend is "
            f"{jax.default_backend()}"
        )
    batch = _batch(rng, "bfloat16")
    static = dict(max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv, return_stats=True, is_causal=True)
    default = jax.jit(functools.partial(ragged_attention, implementation=None, **static))(*batch.args)
    xla = jax.jit(functools.partial(ragged_attention, implementation="xla", **static))(*batch.args)
    for a, b in zip(default, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(default[0], np.float32)).all()  # and it did compute something


def test_cudnn_on_cpu_raises_with_reason(rng):
    if jax.default_backend() != "cpu":
        pytest.skip(f"checks the CPU refusal, backend is {jax.default_backend()}")
    batch = _batch(rng, "bfloat16")
    with pytest.raises(NotImplementedError, match=r"cudnn.*(CUDA|GPU|extension)"):
        ragged_attention(
            *batch.args, max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv, implementation="cudnn"
        )
