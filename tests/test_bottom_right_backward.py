"""The split bottom-right causal backward (backends/cudnn/launch.py _backward) against the float64 reference:
a rectangle call (each sequence's queries against the keys left of its band), then
a top-left square call that writes its dK/dV rows into the rectangle's buffers (dQ is summed).

One batch serves every test: sequences with more keys than queries (a rectangle), fewer (rows without keys),
as many, queries without keys and keys without queries, slots cut by max_seqlen on both sides, and slots of
which seqused uses only a prefix. Every row the op must not read (capacity padding, rows past max_seqlen or
seqused) is NaN in q, k, v and the output cotangent, and must get a gradient of exactly 0.

On a CUDA GPU (skipped elsewhere, with the reason) the real kernels run, for packing "none" and "kv" and both
stats layouts. On a CPU the stand-in of test_stats_grad.py, which does cuDNN's arithmetic on the buffers it is
handed and writes only the rows it owns, runs the same batch plainly, with poisoned outputs and in check mode,
and the calls are checked: which backward call gets initial buffers aliased to its results.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_stats_grad import CudnnArithmetic  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.backends.cudnn import graphs, launch
from jax_ragged_attn.backends.cudnn import options as cudnn_options
from jax_ragged_attn.backends.shared import extension
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.inputs.packed import ragged_attention_kvpacked
from jax_ragged_attn.ops import common
from jax_ragged_attn.testing import assert_close, reference_attention
from jax_ragged_attn.testing.private_config import backend_options

_REASON = extension.cudnn_unavailable_reason()
needs_cudnn = pytest.mark.skipif(_REASON is not None, reason=f"cuDNN path unavailable: {_REASON}")

# Per sequence: slot rows (cu_seqlens) and the rows seqused uses, queries then keys. Sequence 0 has a
# rectangle of 110 keys; 1 has 60 rows without keys; 2 is square; 3 has keys but no queries (its dK/dV are
# 0, written by the rectangle call alone); 4 queries but no keys; 5 is cut by both max_seqlens (128 queries,
# 160 keys: a rectangle of 32); 6 uses 33 of 60 query rows and 71 of 100 key rows (a rectangle of 38).
SLOTS_Q = (40, 90, 64, 0, 20, 170, 60)
USED_Q = (40, 90, 64, 0, 20, 170, 33)
SLOTS_KV = (150, 30, 64, 50, 0, 200, 100)
USED_KV = (150, 30, 64, 50, 0, 200, 71)
MAX_SEQLEN_Q, MAX_SEQLEN_KV = 128, 160
SLACK = 7  # capacity padding after the last slot
CAUSAL = dict(is_causal=True, diagonal_alignment="bottom_right")


def _offsets(slots) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(slots)]).astype(np.int32)


def _lengths(slots, used, max_seqlen) -> np.ndarray:
    return np.minimum(np.minimum(slots, used), max_seqlen)


def _rows(slots, used, max_seqlen) -> np.ndarray:
    """The rows the op reads: the first min(slot, seqused, max_seqlen) of each slot."""
    cu = _offsets(slots)
    lengths = _lengths(slots, used, max_seqlen)
    return np.concatenate([np.arange(cu[b], cu[b] + lengths[b]) for b in range(len(slots))]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Batch:
    q: np.ndarray  # float64 values exactly representable in the dtype, NaN in every unread row
    k: np.ndarray
    v: np.ndarray
    d_out: np.ndarray
    d_stats: np.ndarray  # token-major [Tq, Hq]
    rows_q: np.ndarray
    rows_kv: np.ndarray
    dtype: str

    def args(self):
        """q, k, v in the dtype, then cu_seqlens_q, cu_seqlens_kv, seqused_q, seqused_kv."""
        cast = lambda x: jnp.asarray(x, self.dtype)
        return (
            cast(self.q),
            cast(self.k),
            cast(self.v),
            jnp.asarray(_offsets(SLOTS_Q)),
            jnp.asarray(_offsets(SLOTS_KV)),
            jnp.asarray(USED_Q, jnp.int32),
            jnp.asarray(USED_KV, jnp.int32),
        )


def _batch(seed: int, heads, dim: int, dtype: str) -> Batch:
    rng = np.random.default_rng(seed)
    tq, tkv = sum(SLOTS_Q) + SLACK, sum(SLOTS_KV) + SLACK
    rows_q, rows_kv = _rows(SLOTS_Q, USED_Q, MAX_SEQLEN_Q), _rows(SLOTS_KV, USED_KV, MAX_SEQLEN_KV)

    def poisoned(rows, total, h):
        x = np.full((total, h, dim), np.nan)
        x[rows] = rng.standard_normal((len(rows), h, dim))
        return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the values the op sees

    d_stats = np.zeros((tq, heads[0]))
    d_stats[rows_q] = rng.standard_normal((len(rows_q), heads[0]))
    return Batch(
        poisoned(rows_q, tq, heads[0]),
        poisoned(rows_kv, tkv, heads[1]),
        poisoned(rows_kv, tkv, heads[1]),
        poisoned(rows_q, tq, heads[0]),
        d_stats,
        rows_q,
        rows_kv,
        dtype,
    )


def _expected(batch: Batch, with_stats: bool) -> dict:
    """The float64 reference on the read rows packed tightly, scattered back (every other row 0)."""
    lengths_q = _lengths(SLOTS_Q, USED_Q, MAX_SEQLEN_Q)
    lengths_kv = _lengths(SLOTS_KV, USED_KV, MAX_SEQLEN_KV)
    rq, rkv = batch.rows_q, batch.rows_kv
    tight = reference_attention(
        batch.q[rq],
        batch.k[rkv],
        batch.v[rkv],
        _offsets(lengths_q),
        _offsets(lengths_kv),
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
        **CAUSAL,
        d_out=batch.d_out[rq],
        d_stats=batch.d_stats[rq] if with_stats else None,
    )
    full = {name: np.zeros(x.shape) for name, x in (("dq", batch.q), ("dk", batch.k), ("dv", batch.v))}
    for name, rows in (("dq", rq), ("dk", rkv), ("dv", rkv)):
        full[name][rows] = tight[name]
    return full


def _check(grads, expected: dict, batch: Batch, what: str):
    unread_q = np.setdiff1d(np.arange(batch.q.shape[0]), batch.rows_q)
    unread_kv = np.setdiff1d(np.arange(batch.k.shape[0]), batch.rows_kv)
    for name, grad in zip(("dq", "dk", "dv"), grads):
        grad = np.asarray(grad, np.float64)
        unread = unread_q if name == "dq" else unread_kv
        np.testing.assert_array_equal(grad[unread], 0.0, err_msg=f"{what}{name}: an unread row is not exactly 0")
        assert_close(grad, expected[name], batch.dtype, f"{what}{name}")
    assert all(np.abs(expected[name]).max() > 0 for name in expected)


def _cotangents(batch: Batch, layout: str, with_stats: bool):
    """d_out (NaN rows left in: the op must not read them) and d_stats in the layout (None: stats unused)."""
    d_out = jnp.asarray(batch.d_out, batch.dtype)
    if not with_stats:
        return d_out, None
    d_stats = jnp.asarray(batch.d_stats, jnp.float32)
    return d_out, d_stats if layout == "token_major" else d_stats.T


def _unpacked(grads, packing: str):
    if packing == "none":
        return grads
    d_q, d_kv = grads
    return d_q, d_kv[:, 0], d_kv[:, 1]


# --- On a GPU: the real kernels ---------------------------------------------------------------------------


def _gpu_grads(batch: Batch, packing: str, layout: str, with_stats: bool):
    """jax.vjp of the public op (ragged_attention or ragged_attention_kvpacked) on cuDNN, traced afresh per
    call (testing.config_overrides applies). Without a stats cotangent only `out` is differentiated."""
    q, k, v, cu_q, cu_kv, used_q, used_kv = batch.args()
    d_out, d_stats = _cotangents(batch, layout, with_stats)
    op = ragged_attention if packing == "none" else ragged_attention_kvpacked
    options = dict(
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
        seqused_q=used_q,
        seqused_kv=used_kv,
        stats_layout=layout,
        return_stats=with_stats,
        implementation="cudnn",
        **CAUSAL,
    )

    @jax.jit
    def step(buffers, cu_q, cu_kv, cotangents):
        return jax.vjp(lambda b: op(*b, cu_q, cu_kv, **options), buffers)[1](cotangents)[0]

    buffers = (q, k, v) if packing == "none" else (q, jnp.stack([k, v], axis=1))
    # Sequence 5, cut by both max_seqlens, is invalid: the op reads its rows NaN after the kernels and passes
    # them no cotangent (ops/common.loud, test_loud_rows.py). The kernels' split backward over the rows they
    # are given is what is tested here, so that select is left out.
    with mock.patch.object(common, "loud", lambda out, stats, rows, layout: (out, stats)):
        return _unpacked(step(buffers, cu_q, cu_kv, d_out if d_stats is None else (d_out, d_stats)), packing)


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("packing", ["none", "kv"])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("with_stats", [False, True], ids=["d_out", "d_out_and_d_stats"])
def test_split_matches_the_reference_on_cudnn(packing, layout, with_stats):
    """Without a stats cotangent the backward runs in the packed buffers (the kv packing's square writes its
    rows into the rectangle's dkv); with one, on widened unpacked value columns (stats_grad.py)."""
    batch = _batch(101, (8, 2), 64, "bfloat16")
    split = _gpu_grads(batch, packing, layout, with_stats)
    _check(split, _expected(batch, with_stats), batch, f"split {packing} {layout}: ")


@pytest.mark.gpu
@needs_cudnn
def test_poisoned_outputs_give_the_default_split_results_on_cudnn():
    """The default writes the square's dK/dV rows into the rectangle's buffers; with poisoned outputs (NaN
    first, unowned rows zeroed) the two calls are masked and summed separately, which shows each call writes
    every row it owns. Both agree with each other and the reference."""
    batch = _batch(102, (8, 2), 64, "bfloat16")
    default = _gpu_grads(batch, "none", "head_major", False)
    with backend_options(poison_outputs=True):
        other = _gpu_grads(batch, "none", "head_major", False)
    _check(other, _expected(batch, False), batch, "poisoned: ")
    for name, a, b in zip(("dq", "dk", "dv"), other, default):
        assert_close(np.asarray(a, np.float64), np.asarray(b, np.float64), batch.dtype, f"{name}: vs default")


@pytest.mark.gpu
@needs_cudnn
@pytest.mark.parametrize("packing", ["none", "kv"])
def test_the_square_call_takes_the_rectangles_gradients_aliased_on_cudnn(packing):
    """In the lowered program the split's second backward call gets its initial buffers aliased to its results
    and the first does not: dK/dV are written, not summed."""
    batch = _batch(103, (8, 2), 64, "bfloat16")
    q, k, v, cu_q, cu_kv, used_q, used_kv = batch.args()
    options = dict(
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
        seqused_q=used_q,
        seqused_kv=used_kv,
        implementation="cudnn",
        **CAUSAL,
    )
    op = ragged_attention if packing == "none" else ragged_attention_kvpacked
    buffers = (q, k, v) if packing == "none" else (q, jnp.stack([k, v], axis=1))
    grads = jax.jit(lambda b, d: jax.vjp(lambda b: op(*b, cu_q, cu_kv, **options), b)[1](d)[0])
    hlo = grads.lower(buffers, jnp.asarray(batch.d_out, batch.dtype)).as_text()
    calls = [line for line in hlo.splitlines() if f"@{extension.BACKWARD_TARGET}(" in line]
    assert [("output_operand_aliases" in line) for line in calls] == [False, True], calls


# --- On a CPU: the stand-in that does cuDNN's arithmetic, and the calls the wrapper makes -------------------


class RecordingArithmetic(CudnnArithmetic):
    """The stand-in, also recording each backward call's (initial buffers aliased?, zero_outputs attribute):
    the stand-in itself keeps an initial buffer's rows whatever zero_outputs says, the handler would not."""

    def __init__(self, config):
        super().__init__(config)
        self.backward_calls = []

    def __call__(self, target, result_types, *, vmap_method=None, input_output_aliases=None):
        inner = super().__call__(
            target, result_types, vmap_method=vmap_method, input_output_aliases=input_output_aliases
        )

        def call(*args, **attributes):
            if target == extension.BACKWARD_TARGET:
                self.backward_calls.append((bool(input_output_aliases), int(attributes["zero_outputs"])))
            return inner(*args, **attributes)

        return call


def _stand_in_grads(
    monkeypatch, batch: Batch, packing: str, layout: str, with_stats: bool, check: bool, poison: bool = False
):
    """jax.vjp of launch.attention with the stand-in kernel; returns (dq, dk, dv), the stand-in, the config."""
    q, k, v, cu_q, cu_kv, used_q, used_kv = batch.args()
    config = make_config(
        q,
        k,
        v,
        cu_q,
        cu_kv,
        AttentionOptions(stats_layout=layout, **CAUSAL),
        max_seqlen_q=MAX_SEQLEN_Q,
        max_seqlen_kv=MAX_SEQLEN_KV,
    )
    config = dataclasses.replace(config, packing=packing, guard_workspace=check)
    monkeypatch.setattr(cudnn_options, "OPTIONS", cudnn_options.CudnnOptions(poison_outputs=poison))
    kernel = RecordingArithmetic(config)
    monkeypatch.setattr(jax.ffi, "ffi_call", kernel)
    monkeypatch.setattr(launch, "graph_info", lambda direction, config, layout=None: {"workspace_bytes": 64})
    buffers = (q, k, v) if packing == "none" else (q, jnp.stack([k, v], axis=1))
    d_out, d_stats = _cotangents(batch, layout, with_stats)

    def grads(buffers, d_out, d_stats):
        (out, stats), vjp = jax.vjp(lambda b: launch.attention(b, cu_q, cu_kv, config, (used_q, used_kv)), buffers)
        return vjp((d_out, jnp.zeros_like(stats) if d_stats is None else d_stats))[0]

    if d_stats is None:  # a symbolic zero for stats: the plain backward, in the packed buffers
        grads = lambda buffers, d_out, _: jax.vjp(
            lambda b: launch.attention(b, cu_q, cu_kv, config, (used_q, used_kv))[0], buffers
        )[1](d_out)[0]
    return _unpacked(jax.jit(grads)(buffers, d_out, d_stats), packing), kernel, config


# The backward calls' (initial buffers aliased?, zero_outputs: graphs.ZERO_OUTPUTS' index) plainly, with
# poisoned outputs and in check mode, plain backward in packing none or kv: where the rectangle's call leaves
# its unowned rows 0, the square's takes the rectangle's dK/dV (and a zero dQ) and zeroes nothing, or it would
# zero the rectangle's rows.
NO, UNOWNED, POISONED = (graphs.ZERO_OUTPUTS.index(m) for m in ("no", "unowned", "poisoned"))
BACKWARD_CALLS = {
    "unowned": [(False, UNOWNED), (True, NO)],
    "poisoned": [(False, POISONED), (False, POISONED)],
    "check": [(True, NO), (True, NO)],
}


@pytest.mark.parametrize("mode", sorted(BACKWARD_CALLS))
@pytest.mark.parametrize("packing", ["none", "kv"])
def test_split_on_the_stand_in_writes_key_rows_in_place_where_it_can(monkeypatch, packing, mode):
    batch = _batch(7, (4, 2), 16, "bfloat16")
    split, kernel, config = _stand_in_grads(
        monkeypatch, batch, packing, "head_major", False, mode == "check", poison=mode == "poisoned"
    )
    assert kernel.backward_calls == BACKWARD_CALLS[mode]
    assert launch._writes_key_rows_in_place(config) == (mode == "unowned")
    _check(split, _expected(batch, False), batch, f"split {packing} {mode}: ")


@pytest.mark.parametrize("layout", ["head_major", "token_major"])
@pytest.mark.parametrize("packing", ["none", "kv"])
def test_split_on_the_stand_in_with_a_stats_cotangent(monkeypatch, packing, layout):
    """A stats cotangent takes the widened unpacked backward (stats_grad.py), split the same way."""
    batch = _batch(8, (4, 2), 16, "bfloat16")
    split, kernel, _ = _stand_in_grads(monkeypatch, batch, packing, layout, True, False)
    assert kernel.backward_calls == BACKWARD_CALLS["unowned"]
    _check(split, _expected(batch, True), batch, f"split {packing} {layout} with d_stats: ")


def test_the_qkv_packing_keeps_the_sum():
    """Its one gradient buffer holds dQ, whose rows both calls write: nothing to write in place."""
    q = jax.ShapeDtypeStruct((64, 4, 16), jnp.bfloat16)
    cu = jax.ShapeDtypeStruct((3,), jnp.int32)
    config = make_config(q, q, q, cu, cu, AttentionOptions(**CAUSAL), max_seqlen_q=32, max_seqlen_kv=32)
    assert launch._writes_key_rows_in_place(config)
    assert not launch._writes_key_rows_in_place(dataclasses.replace(config, packing="qkv"))
