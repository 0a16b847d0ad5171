"""backends/shared/row_zeroing.zero_unused_rows: the rows no sequence uses set to 0, every other row untouched.

On a GPU the extension's zero-rows handler does it in place (ffi/zero_rows.cc), also where XLA does not
honour the alias (vmap's sequential loop) and on jit arguments (XLA copies first, the caller's array keeps
its values); elsewhere a jnp.where does it. Both are checked bit for bit against NumPy on NaN-filled
buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn.backends.shared import row_zeroing

CU = np.array([0, 3, 3, 8, 10], np.int32)  # T = 13: rows 10..12 are capacity padding
LENGTHS = np.array([2, 0, 5, 1], np.int32)  # row 2 is past sequence 0's used end, row 9 past sequence 3's
GATE = np.array([1, 1, 0, 1], np.int32)  # sequence 2 owns no row


def _expected(x, gate=None):
    owned = np.zeros(x.shape[0], bool)
    for b in range(len(LENGTHS)):
        if gate is None or gate[b] > 0:
            owned[CU[b] : CU[b] + LENGTHS[b]] = True
    return np.where(owned.reshape((-1,) + (1,) * (x.ndim - 1)), np.asarray(x), 0)


def _buffers():
    key = jax.random.key(0)
    a = jax.random.normal(key, (13, 4, 8), jnp.bfloat16)
    b = jnp.full((13, 2, 16), jnp.nan, jnp.float32).at[:, :, :3].set(1.5)
    return a, b


@pytest.mark.parametrize("gate", [None, GATE], ids=["no_gate", "gate"])
def test_unused_rows_are_zero_and_the_rest_untouched(gate):
    a, b = _buffers()
    f = jax.jit(
        lambda a, b: row_zeroing.zero_unused_rows(
            (a, b), jnp.asarray(CU), jnp.asarray(LENGTHS), None if gate is None else jnp.asarray(gate)
        )
    )
    got_a, got_b = f(a, b)
    np.testing.assert_array_equal(np.asarray(got_a, np.float32), _expected(np.asarray(a, np.float32), gate))
    np.testing.assert_array_equal(np.asarray(got_b), _expected(np.asarray(b), gate))
    assert np.isnan(np.asarray(b)[12, 0, 5]), "the caller's array keeps its values"


def test_many_buffers_of_different_rows_and_widths_in_one_call():
    """Six buffers in one call, past the kernel's four a launch (ffi/row_zeroing_params.h), of 16-byte, 4-byte
    and narrow rows, three of them shorter than the index reaches: each zeroed exactly, bit for bit."""
    rng = np.random.default_rng(3)
    shapes = [
        ((13, 4, 8), jnp.bfloat16),
        ((13, 3, 5), jnp.float32),
        ((9, 32, 128), jnp.bfloat16),
        ((13, 2, 6), jnp.bfloat16),
        ((4, 7), jnp.float32),
        ((11, 1, 2), jnp.float16),
    ]
    buffers = tuple(
        jnp.asarray(np.where(rng.random(shape) < 0.2, np.nan, rng.normal(size=shape)), dtype) for shape, dtype in shapes
    )
    got = jax.jit(
        lambda *xs: row_zeroing.zero_unused_rows(xs, jnp.asarray(CU), jnp.asarray(LENGTHS), jnp.asarray(GATE))
    )(*buffers)
    for i, (x, y) in enumerate(zip(buffers, got)):
        x32 = np.asarray(x, np.float32)
        expected = _expected(np.pad(x32, [(0, 13 - x.shape[0])] + [(0, 0)] * (x.ndim - 1)), GATE)[: x.shape[0]]
        np.testing.assert_array_equal(np.asarray(y, np.float32), expected, err_msg=f"buffer {i} {x.shape}")


def test_under_vmap():
    a, _ = _buffers()
    stacked = jnp.stack([a, 2 * a])
    got = jax.jit(jax.vmap(lambda x: row_zeroing.zero_unused_rows((x,), jnp.asarray(CU), jnp.asarray(LENGTHS))[0]))(
        stacked
    )
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i], np.float32), _expected(np.asarray(stacked[i], np.float32)))


@pytest.mark.gpu
def test_the_gpu_uses_the_handler():
    if jax.default_backend() != "gpu":
        pytest.skip("the zero-rows handler runs on a CUDA GPU; this backend uses the jnp.where")
    a, _ = _buffers()
    text = (
        jax.jit(lambda a: row_zeroing.zero_unused_rows((a,), jnp.asarray(CU), jnp.asarray(LENGTHS))[0])
        .lower(a)
        .as_text()
    )
    assert "jax_ragged_attn_zero_rows" in text


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, dtype",
    [((4, 8), "bfloat16"), ((3, 5), "float32"), ((32, 128), "bfloat16"), ((2, 6), "bfloat16")],
    ids=["64-byte rows", "60-byte rows (4-byte stores)", "8-KiB rows", "24-byte rows"],
)
def test_the_kernel_zeroes_exactly_the_unused_rows_of_every_row_width(shape, dtype):
    """The row-zeroing kernel on the GPU (16-byte stores where a row is whole 16-byte words, 4-byte stores
    otherwise), over many warps of rows, most of them unused as in a context-parallel key window: bit for bit
    against NumPy on a NaN-filled buffer."""
    if jax.default_backend() != "gpu":
        pytest.skip("the zero-rows handler runs on a CUDA GPU; this backend uses the jnp.where")
    rng = np.random.default_rng(7)
    rows, num = 5000, 40
    cu = np.sort(rng.choice(rows, num + 1, replace=False)).astype(np.int32)
    cu[0] = 0
    lengths = (rng.random(num) * np.diff(cu) * 0.3).astype(np.int32)  # ~85 % of the rows unused
    x = jnp.full((rows, *shape), jnp.nan, dtype)
    got = jax.jit(lambda x: row_zeroing.zero_unused_rows((x,), jnp.asarray(cu), jnp.asarray(lengths))[0])(x)
    owned = np.zeros(rows, bool)
    for b in range(num):
        owned[cu[b] : cu[b] + lengths[b]] = True
    got = np.asarray(got, np.float32)
    assert np.isnan(got[owned]).all(), "a used row was written"
    np.testing.assert_array_equal(got[~owned], 0, err_msg="an unused row was not zeroed")
