"""The portable xla implementation against the float64 NumPy reference, through the public API.

Every case draws fresh inputs from a seed derived from its test id, so a failure reproduces with
`pytest tests/test_xla_path.py -k '<id>'`. Padding rows are NaN-poisoned: a NaN in any result proves
padding leaked.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.testing.reference import reference_attention
from jax_ragged_attn.testing import assert_close, packed_batch, random_lengths


@dataclasses.dataclass(frozen=True)
class Case:
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...] | None = None  # None: same as seqlens_q
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    dims: tuple[int, int] = (16, 16)  # (Dqk, Dv)
    is_causal: bool = False
    diagonal_alignment: str = "top_left"
    local_window_size: int | tuple[int, int] | None = None
    slack: tuple[int, int] = (3, 2)  # capacity padding rows of q and of k/v
    scale: float | None = None

    def options(self) -> dict:
        return dict(
            scale=self.scale,
            is_causal=self.is_causal,
            diagonal_alignment=self.diagonal_alignment,
            local_window_size=self.local_window_size,
        )


CASES = {
    "mha": Case((5, 3, 7), heads=(2, 2)),
    "empty_first_middle_last": Case((0, 4, 0, 6, 0), (0, 5, 0, 3, 0)),
    "empty_kv_only": Case((3, 4, 2), (0, 5, 0)),  # query rows with no key at all
    "all_empty": Case((0, 0), (0, 0)),
    "no_capacity_padding": Case((4, 6), (5, 2), slack=(0, 0)),
    "gqa_causal": Case((5, 7, 2), heads=(6, 2), is_causal=True),
    "mqa_causal_bottom_right": Case((3, 6, 4), (7, 4, 4), heads=(4, 1), is_causal=True,
                                    diagonal_alignment="bottom_right"),
    "bottom_right_window": Case((6, 2), (3, 7), local_window_size=2, diagonal_alignment="bottom_right"),
    "window_int": Case((7, 5), local_window_size=1),
    "window_tuple_causal": Case((8, 3), (6, 5), local_window_size=(3, 1), is_causal=True),
    "window_asymmetric_bottom_right_causal": Case((4, 7), (6, 3), local_window_size=(0, 2), is_causal=True,
                                                  diagonal_alignment="bottom_right"),
    "window_right_only": Case((6, 5), local_window_size=(9, 0)),
    "dv_differs_gqa": Case((4, 6), (7, 3), heads=(6, 3), dims=(8, 24)),
    "custom_scale_mqa": Case((5, 4), heads=(3, 1), scale=0.3),
}
# The low-precision sweep takes the cases that exercise the most masking; float32 takes them all.
LOW_PRECISION_CASES = ("empty_first_middle_last", "mqa_causal_bottom_right", "window_tuple_causal",
                       "dv_differs_gqa")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CASE_DTYPES = [pytest.param(name, "float32", id=f"{name}-float32") for name in CASES] + [
    pytest.param(name, dtype, id=f"{name}-{dtype}") for name in LOW_PRECISION_CASES for dtype in ("bfloat16",
                                                                                                  "float16")
]
LAYOUTS = ("head_major", "token_major")


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded by the test's own id: fresh inputs per case, the same ones on every rerun."""
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def make_batch(rng, case: Case, dtype):
    seqlens_kv = case.seqlens_q if case.seqlens_kv is None else case.seqlens_kv
    return packed_batch(
        rng,
        case.seqlens_q,
        seqlens_kv,
        num_heads_q=case.heads[0],
        num_heads_kv=case.heads[1],
        head_dim_qk=case.dims[0],
        head_dim_v=case.dims[1],
        dtype=DTYPES[dtype],
        slack_q=case.slack[0],
        slack_kv=case.slack[1],
    )


def attention(batch, case: Case, *, stats_layout="token_major"):
    """The op under test as a function of (q, k, v) alone, returning (out, stats)."""
    return functools.partial(
        ragged_attention,
        cu_seqlens_q=batch.cu_seqlens_q,
        cu_seqlens_kv=batch.cu_seqlens_kv,
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        stats_layout=stats_layout,
        return_stats=True,
        implementation="xla",
        **case.options(),
    )


def reference(batch, case: Case, **cotangents):
    return reference_attention(*batch.reference_args, max_seqlen_q=batch.max_seqlen_q,
                               max_seqlen_kv=batch.max_seqlen_kv, **case.options(), **cotangents)


def forward_and_vjp(f, primals, cotangent):
    """(f(*primals), its vjp applied to cotangent), under one jax.jit.

    One compilation is much faster on CPU than dispatching the op's many small ops one by one.
    """

    def run(primals, cotangent):
        outputs, vjp = jax.vjp(f, *primals)
        return outputs, vjp(cotangent)

    return jax.jit(run)(primals, cotangent)


def cotangents(rng, batch):
    """Random cotangents for (out, stats), token-major, non-zero on padding rows too: they must be ignored.

    Returned in float64 but already rounded to the dtypes the op receives them in (out's dtype, float32).
    """
    tq, hq = batch.q.shape[:2]
    d_out = rng.standard_normal((tq, hq, batch.v.shape[2])).astype(batch.q.dtype).astype(np.float64)
    d_stats = rng.standard_normal((tq, hq)).astype(np.float32).astype(np.float64)
    return d_out, d_stats


def check_forward(out, stats, expected, batch, dtype, what=""):
    """out and token-major stats against the reference, and exact zeros / -inf where nothing is attended."""
    assert out.dtype == batch.q.dtype, f"{what}out dtype {out.dtype}, expected {batch.q.dtype}"
    assert stats.dtype == jnp.float32, f"{what}stats dtype {stats.dtype}, expected float32"
    out, stats = np.asarray(out, dtype=np.float64), np.asarray(stats, dtype=np.float64)
    assert_close(out, expected["out"], dtype, f"{what}out")
    assert_close(stats, expected["stats"], dtype, f"{what}stats")
    # assert_close only bounds these; padding rows and rows without keys must be exact.
    empty = np.isneginf(expected["stats"])  # [Tq, Hq]: padding rows and rows that attend nothing
    assert empty[batch.padding_q].all()
    np.testing.assert_array_equal(out[empty], 0.0, err_msg=f"{what}out of rows that attend no key")
    np.testing.assert_array_equal(stats[empty], -np.inf, err_msg=f"{what}stats of rows that attend no key")


def check_gradients(grads, expected, batch, dtype, what=""):
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (batch.q, batch.k, batch.v)):
        assert grad.dtype == like.dtype, f"{what}{name} dtype {grad.dtype}, expected {like.dtype}"
        assert_close(grad, expected[name], dtype, f"{what}{name}")
    dq, dk, dv = (np.asarray(g, dtype=np.float64) for g in grads)
    empty_rows = np.isneginf(expected["stats"]).all(axis=1)
    np.testing.assert_array_equal(dq[empty_rows], 0.0, err_msg=f"{what}dq of padding rows / rows without keys")
    np.testing.assert_array_equal(dk[batch.padding_kv], 0.0, err_msg=f"{what}dk of padding rows")
    np.testing.assert_array_equal(dv[batch.padding_kv], 0.0, err_msg=f"{what}dv of padding rows")


@pytest.mark.parametrize("case_name, dtype", CASE_DTYPES)
def test_forward_both_stats_layouts(rng, case_name, dtype):
    case = CASES[case_name]
    batch = make_batch(rng, case, dtype)
    expected = reference(batch, case)
    out, stats = jax.jit(attention(batch, case, stats_layout="token_major"))(batch.q, batch.k, batch.v)
    assert stats.shape == batch.q.shape[:2]
    check_forward(out, stats, expected, batch, dtype, "token_major: ")

    out_hm, stats_hm = jax.jit(attention(batch, case, stats_layout="head_major"))(batch.q, batch.k, batch.v)
    assert stats_hm.shape == batch.q.shape[1::-1]
    check_forward(out_hm, stats_hm.T, expected, batch, dtype, "head_major: ")


@pytest.mark.parametrize("case_name, dtype", CASE_DTYPES)
def test_gradients_with_stats_cotangent(rng, case_name, dtype):
    case = CASES[case_name]
    batch = make_batch(rng, case, dtype)
    d_out, d_stats = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out, d_stats=d_stats)
    # Alternate layouts between cases: the head-major cotangent must be transposed on its way back.
    layout = LAYOUTS[list(CASES).index(case_name) % 2]
    stats_cotangent = d_stats if layout == "token_major" else d_stats.T
    cotangent = (jnp.asarray(d_out, batch.q.dtype), jnp.asarray(stats_cotangent, jnp.float32))
    (out, stats), grads = forward_and_vjp(attention(batch, case, stats_layout=layout), batch.args[:3], cotangent)
    check_forward(out, stats if layout == "token_major" else stats.T, expected, batch, dtype, f"{layout}: ")
    check_gradients(grads, expected, batch, dtype, f"{layout}: ")


def random_case(rng) -> Case:
    """A configuration drawn with weights towards the awkward corners: empty sequences, sq != skv, masks."""
    num_seqs = int(rng.integers(1, 6))
    seqlens_q = random_lengths(rng, num_seqs, 0, 9)
    seqlens_kv = seqlens_q if rng.random() < 0.3 else random_lengths(rng, num_seqs, 0, 9)
    hkv = int(rng.choice([1, 2]))
    window = [None, None, int(rng.integers(0, 4)), (int(rng.integers(0, 4)), int(rng.integers(0, 4)))]
    return Case(
        seqlens_q,
        seqlens_kv,
        heads=(hkv * int(rng.choice([1, 2, 3])), hkv),
        dims=(int(rng.choice([8, 16])), int(rng.choice([8, 16, 24]))),
        is_causal=bool(rng.random() < 0.5),
        diagonal_alignment=str(rng.choice(["top_left", "bottom_right"])),
        local_window_size=window[int(rng.integers(len(window)))],
        slack=(int(rng.integers(0, 4)), int(rng.integers(0, 4))),
    )


@pytest.mark.parametrize("draw", range(6))
def test_random_configuration(rng, draw):
    """Forward and gradients for a drawn configuration; a failure message starts with the Case to paste."""
    case = random_case(rng)
    dtype = ("float32", "bfloat16")[draw % 2]
    batch = make_batch(rng, case, dtype)
    d_out, d_stats = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out, d_stats=d_stats)
    layout = LAYOUTS[draw // 2 % 2]
    stats_cotangent = d_stats if layout == "token_major" else d_stats.T
    cotangent = (jnp.asarray(d_out, batch.q.dtype), jnp.asarray(stats_cotangent, jnp.float32))
    (out, stats), grads = forward_and_vjp(attention(batch, case, stats_layout=layout), batch.args[:3], cotangent)
    what = f"{case} {dtype} {layout}: "
    check_forward(out, stats if layout == "token_major" else stats.T, expected, batch, dtype, what)
    check_gradients(grads, expected, batch, dtype, what)


@pytest.mark.parametrize("case_name", ["empty_first_middle_last", "gqa_causal", "window_tuple_causal"])
def test_grad_of_output_only_loss(rng, case_name):
    """return_stats=False: jax.grad of a scalar loss of out alone, i.e. a zero stats cotangent."""
    case = CASES[case_name]
    batch = make_batch(rng, case, "float32")
    d_out, _ = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out)

    def loss(q, k, v):
        out = ragged_attention(q, k, v, batch.cu_seqlens_q, batch.cu_seqlens_kv, max_seqlen_q=batch.max_seqlen_q,
                               max_seqlen_kv=batch.max_seqlen_kv, implementation="xla", **case.options())
        return jnp.sum(out * d_out)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(batch.q, batch.k, batch.v)
    check_gradients(grads, expected, batch, "float32")


def test_sequences_longer_than_max_seqlen_are_clamped(rng):
    """Rows of a sequence past max_seqlen are not part of it: out 0, stats -inf, no gradient, never read."""
    case = Case((6, 2, 5), (3, 7, 4), heads=(4, 2), is_causal=True, diagonal_alignment="bottom_right")
    batch = make_batch(rng, case, "float32")
    max_q, max_kv = 4, 5
    # Poison the clamped-away rows too, so reading them would show up as NaN.
    cu_q, cu_kv = np.asarray(batch.cu_seqlens_q), np.asarray(batch.cu_seqlens_kv)
    q, k, v = np.array(batch.q), np.array(batch.k), np.array(batch.v)
    for cu, arrays, limit in ((cu_q, (q,), max_q), (cu_kv, (k, v), max_kv)):
        for start, stop in zip(cu[:-1], cu[1:]):
            for a in arrays:
                a[start + limit:stop] = np.nan
    batch = dataclasses.replace(batch, q=jnp.asarray(q), k=jnp.asarray(k), v=jnp.asarray(v), max_seqlen_q=max_q,
                                max_seqlen_kv=max_kv, q64=q.astype(np.float64), k64=k.astype(np.float64),
                                v64=v.astype(np.float64))
    d_out, d_stats = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out, d_stats=d_stats)
    assert np.isneginf(expected["stats"][cu_q[0] + max_q]).all()  # the case does clamp rows away
    (out, stats), grads = forward_and_vjp(attention(batch, case), batch.args[:3],
                                          (jnp.asarray(d_out, jnp.float32), jnp.asarray(d_stats, jnp.float32)))
    check_forward(out, stats, expected, batch, "float32")
    check_gradients(grads, expected, batch, "float32")
    clamped_kv = np.isnan(k).any(axis=(1, 2))
    np.testing.assert_array_equal(np.asarray(grads[1])[clamped_kv], 0.0, err_msg="dk of clamped rows")


@pytest.mark.parametrize("case_name, dtype", [("window_tuple_causal", "bfloat16")])
def test_eager_matches_reference_and_jit_is_deterministic(rng, case_name, dtype):
    """The other tests run under jit; this one runs the op eagerly, then twice under jit, bit for bit."""
    case = CASES[case_name]
    batch = make_batch(rng, case, dtype)
    d_out, d_stats = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out, d_stats=d_stats)
    f = attention(batch, case, stats_layout="head_major")
    cotangent = (jnp.asarray(d_out, batch.q.dtype), jnp.asarray(d_stats.T, jnp.float32))

    (out, stats), vjp = jax.vjp(f, *batch.args[:3])
    check_forward(out, stats.T, expected, batch, dtype, "eager: ")
    check_gradients(vjp(cotangent), expected, batch, dtype, "eager: ")

    first = forward_and_vjp(f, batch.args[:3], cotangent)
    second = forward_and_vjp(f, batch.args[:3], cotangent)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg="two jitted runs differ")


def test_vmap_over_two_batches(rng):
    """Two batches of the same capacities but different lengths, stacked on a leading axis."""
    case = Case((3, 5, 0), (4, 2, 6), heads=(4, 2), is_causal=True, local_window_size=(2, 3))
    other = Case((0, 6, 4), (7, 0, 3), heads=(4, 2), is_causal=True, local_window_size=(2, 3), slack=(1, 4))
    batches = [make_batch(rng, c, "float32") for c in (case, other)]
    assert batches[0].q.shape == batches[1].q.shape and batches[0].k.shape == batches[1].k.shape
    max_q = max(b.max_seqlen_q for b in batches)
    max_kv = max(b.max_seqlen_kv for b in batches)
    d_outs, d_stats = zip(*(cotangents(rng, b) for b in batches))

    def f(q, k, v, cu_q, cu_kv):
        return ragged_attention(q, k, v, cu_q, cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                                stats_layout="token_major", return_stats=True, implementation="xla",
                                **case.options())

    stacked = [jnp.stack(parts) for parts in zip(*(b.args for b in batches))]
    (out, stats), grads = forward_and_vjp(jax.vmap(f), stacked, (jnp.asarray(np.stack(d_outs), jnp.float32),
                                                                 jnp.asarray(np.stack(d_stats), jnp.float32)))
    grads = grads[:3]  # the cu_seqlens are integers: their cotangents are float0
    for i, batch in enumerate(batches):
        expected = reference_attention(*batch.reference_args, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                                       **case.options(), d_out=d_outs[i], d_stats=d_stats[i])
        check_forward(out[i], stats[i], expected, batch, "float32", f"batch {i}: ")
        check_gradients([g[i] for g in grads], expected, batch, "float32", f"batch {i}: ")


def test_checkpoint(rng):
    case = CASES["mqa_causal_bottom_right"]
    batch = make_batch(rng, case, "float32")
    d_out, d_stats = cotangents(rng, batch)
    expected = reference(batch, case, d_out=d_out, d_stats=d_stats)
    f = attention(batch, case)

    @jax.checkpoint
    def loss(q, k, v):
        out, stats = f(q, k, v)
        # -inf stats rows get a zero weight through `where`, so the loss stays finite.
        return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(stats), stats * d_stats, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(batch.q, batch.k, batch.v)
    check_gradients(grads, expected, batch, "float32")


def test_default_implementation_on_cpu_is_xla(rng):
    if jax.default_backend() != "cpu":
        pytest.skip(f"implementation=None picks cuDNN when it can; this checks the CPU fallback, backend is "
                    f"{jax.default_backend()}")
    case = CASES["gqa_causal"]
    batch = make_batch(rng, case, "bfloat16")
    static = dict(max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv, return_stats=True,
                  **case.options())
    default = jax.jit(functools.partial(ragged_attention, implementation=None, **static))(*batch.args)
    xla = jax.jit(functools.partial(ragged_attention, implementation="xla", **static))(*batch.args)
    for a, b in zip(default, xla):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cudnn_on_cpu_raises_with_reason(rng):
    if jax.default_backend() != "cpu":
        pytest.skip(f"checks the CPU refusal, backend is {jax.default_backend()}")
    # bfloat16 and head dims that are multiples of 8: the only obstacle left is the missing GPU.
    batch = make_batch(rng, Case((3, 4), dims=(16, 8)), "bfloat16")
    with pytest.raises(NotImplementedError, match=r"cudnn.*(CUDA|GPU|extension)"):
        ragged_attention(*batch.args, max_seqlen_q=batch.max_seqlen_q, max_seqlen_kv=batch.max_seqlen_kv,
                         implementation="cudnn")
