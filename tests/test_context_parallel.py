"""Context parallelism: the packed token axis split over devices (sharded_ragged_attention(token_axis=...)).

The piece metadata is checked on its own against a dense segment-causal mask; the sharded op runs on 4
virtual CPU devices in a child interpreter (this file run as a script, as tests/test_sharding.py does: the
device count is fixed when JAX initialises) against the unsharded op and the float64 reference, each check
printing one JSON line. Reproduce by hand with
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python tests/test_context_parallel.py
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from tiers import some_fast  # tests/ is on sys.path under pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.parallel.pieces import chunk_pieces, pieces_cu_seqlens
from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, restore_order, sharded_ragged_attention
from jax_ragged_attn.testing import assert_close, implementation_options, packed_batch
from jax_ragged_attn.testing.documents import dense_mask, random_document_lengths
from jax_ragged_attn.testing.multidevice import cudnn_gpus, report_checks, run_checks_in_child
from jax_ragged_attn.testing.reference import reference_attention

EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto
T = 64  # 4 devices: shards of 16 rows, balanced chunks of 8


def random_lengths(rng, total: int, *, slack: int) -> list[int]:
    return random_document_lengths(rng, total, slack=slack, longest=(20, 31))


def prefix_sum_mask(cu_q, cu_kv, rows: int, total: int, is_causal: bool, window_left) -> np.ndarray:
    """[rows, T] bool: what the op attends for these cu_seqlens, bottom-right aligned (ragged_attention's
    documented semantics, spelled out again)."""
    mask = np.zeros((rows, total), bool)
    for b in range(len(cu_q) - 1):
        sq, skv = int(cu_q[b + 1] - cu_q[b]), int(cu_kv[b + 1] - cu_kv[b])
        i = np.arange(sq)[:, None] + (skv - sq)  # the diagonal
        j = np.arange(skv)[None, :]
        keep = np.ones((sq, skv), bool)
        if is_causal:
            keep &= j <= i
        if window_left is not None:
            keep &= j >= i - window_left
        mask[cu_q[b] : cu_q[b + 1], cu_kv[b] : cu_kv[b + 1]] = keep
    return mask


def chunks(n: int, load_balance: bool):
    """(chunk index, rows) of every chunk, one call each."""
    if load_balance:
        return [(c, T // (2 * n)) for c in range(2 * n)]
    return [(c, T // n) for c in range(n)]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("n, load_balance", [(2, False), (4, False), (2, True), (4, True)])
@pytest.mark.parametrize("is_causal, window_left", [(True, None), (False, None), (True, 5)])
def test_pieces_give_the_dense_segment_mask(seed, n, load_balance, is_causal, window_left):
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, T, slack=int(rng.integers(0, 7)))
    max_seqlen = int(rng.choice([max(lengths), max(lengths) - 3]))  # sometimes cutting the longest document
    cu = cu_seqlens_from_lengths(lengths)
    want = dense_mask(cu, T, max_seqlen, is_causal, window_left)
    for chunk, rows in chunks(n, load_balance):
        start = chunk * rows
        pieces = chunk_pieces(
            jnp.asarray(cu), start, rows, max_seqlen=max_seqlen, is_causal=is_causal, window_left=window_left
        )
        q_start, q_len, kv_start, kv_len = (np.asarray(x) for x in pieces)
        # The pieces themselves: each query row's piece holds exactly the keys the dense mask gives it.
        got = np.zeros((rows, T), bool)
        for b in range(len(lengths)):
            for i in range(q_start[b], q_start[b] + q_len[b]):
                position = start + i - cu[b]
                j = np.arange(kv_start[b], kv_start[b] + kv_len[b])
                keep = np.ones(j.shape, bool)
                if is_causal:
                    keep &= j - cu[b] <= position
                if window_left is not None:
                    keep &= j - cu[b] >= position - window_left
                got[i, j] = keep
        np.testing.assert_array_equal(got, want[start : start + rows], err_msg=f"pieces of chunk {chunk}")
        if is_causal and window_left is None:  # a piece's keys are exactly those its last query needs
            assert all(kv_start[b] == cu[b] for b in range(len(lengths)) if q_len[b])
        # No two pieces share key rows: the cuDNN backward writes dK/dV per sequence.
        ends = kv_start + kv_len
        assert np.all(kv_start[1:] >= ends[:-1]) and np.all(q_start[1:] >= q_start[:-1] + q_len[:-1])
        # The same pieces as the op reads them: a prefix sum with gap sequences, bottom-right aligned.
        cu_q, cu_kv = (np.asarray(x) for x in pieces_cu_seqlens(pieces))
        assert np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_kv) >= 0) and cu_q[-1] <= rows and cu_kv[-1] <= T
        np.testing.assert_array_equal(
            prefix_sum_mask(cu_q, cu_kv, rows, T, is_causal, window_left),
            want[start : start + rows],
            err_msg=f"cu_seqlens of chunk {chunk}",
        )


@pytest.mark.parametrize("starts", [(0, 5), (3, 3), (10, 0), (9, 2)], ids=["apart", "same", "last-first", "overlap"])
def test_key_windows_and_their_gradient(starts):
    """key_windows.windows: the rows [s, s + size) of each start side by side, and its own backward (one
    pass over the rows) equal to autodiff of the plain slices, overlapping windows summed."""
    from jax_ragged_attn.parallel.key_windows import windows

    x = jnp.asarray(np.random.default_rng(0).standard_normal((15, 2, 3)), jnp.float32)
    g = jnp.asarray(np.random.default_rng(1).standard_normal((2 * 5, 2, 3)), jnp.float32)
    plain = lambda x, a, b: jnp.concatenate([lax.dynamic_slice_in_dim(x, s, 5) for s in (a, b)])
    a, b = (jnp.int32(s) for s in starts)
    got, pullback = jax.vjp(jax.jit(lambda x, a, b: windows(x, (a, b), 5)), x, a, b)
    want, plain_pullback = jax.vjp(lambda x: plain(x, a, b), x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(pullback(g)[0], plain_pullback(g)[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "no-mask"])
@pytest.mark.parametrize("seed", range(4))
def test_key_window_holds_every_key_of_its_chunk(seed, is_causal):
    """key_windows.window_bounds: every key row a chunk's pieces attend lies inside the chunk's window (the
    calls clip piece offsets into it, so a piece reaching outside would read the wrong rows), for windows
    narrower than T."""
    from jax_ragged_attn.parallel.key_windows import window_bounds

    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, T, slack=int(rng.integers(0, 20)))
    max_seqlen = int(rng.integers(1, max(lengths) + 2))  # may cut sequences: their tails are padding
    cu = jnp.asarray(cu_seqlens_from_lengths(lengths))
    for rows in (T // 8, T // 4):
        for start in range(0, T, rows):
            p = chunk_pieces(cu, start, rows, max_seqlen=max_seqlen, is_causal=is_causal)
            first, size = window_bounds(T, start, rows, max_seqlen=max_seqlen, is_causal=is_causal)
            first = int(first)
            assert 0 <= first and first + size <= T
            used = np.asarray(p.q_len) > 0
            kv_start, kv_len = np.asarray(p.kv_start)[used], np.asarray(p.kv_len)[used]
            assert np.all(kv_start >= first) and np.all(kv_start + kv_len <= first + size), (start, first, size)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [2, 4])
def test_two_chunks_fit_in_b_plus_one_ascending_slots(seed, n):
    """pieces.two_chunk_slots: a device's two chunks' pieces as B + 1 slots, every non-empty piece
    exactly once, offsets ascending and each slot's used rows inside it (the kernels' contract)."""
    from jax_ragged_attn.parallel.pieces import Pieces, two_chunk_slots

    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, T, slack=int(rng.integers(0, 20)))
    if seed == 5:
        lengths = [3, 0, 4]  # most chunks hold no piece at all
    cu = jnp.asarray(cu_seqlens_from_lengths(lengths))
    rows, size = T // (2 * n), T  # windows of all T rows: every key offset in the call is exact
    for r in range(n):
        parts = []
        for j, chunk in enumerate((r, 2 * n - 1 - r)):
            p = chunk_pieces(cu, chunk * rows, rows, max_seqlen=max(lengths), is_causal=True)
            parts.append(Pieces(j * rows + p.q_start, p.q_len, j * size + p.kv_start, p.kv_len))
        slots = [np.asarray(x) for x in two_chunk_slots(*parts)]
        assert all(x.shape == (len(lengths) + 1,) for x in slots)
        q_start, q_len, kv_start, kv_len = slots
        cu_q, cu_kv = np.append(q_start, 2 * rows), np.append(kv_start, 2 * size)
        assert np.all(np.diff(cu_q) >= 0) and np.all(np.diff(cu_kv) >= 0), (cu_q, cu_kv)
        assert np.all(q_start + q_len <= cu_q[1:]) and np.all(kv_start + kv_len <= cu_kv[1:])
        want = sorted(
            (int(a), int(b), int(c), int(d)) for part in parts for a, b, c, d in zip(*map(np.asarray, part)) if b > 0
        )
        got = sorted((int(a), int(b), int(c), int(d)) for a, b, c, d in zip(*slots) if b > 0)
        assert got == want, f"device {r}"


def test_reorder_is_the_dual_chunk_order_and_restore_undoes_it():
    x = jnp.arange(16 * 3).reshape(16, 3)
    y = reorder_for_load_balance(x, 2)
    np.testing.assert_array_equal(np.asarray(y[:, 0]) // 3 // 4, [0, 0, 0, 0, 3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2])
    np.testing.assert_array_equal(restore_order(y, 2), x)
    np.testing.assert_array_equal(restore_order(reorder_for_load_balance(x.T, 4, axis=1), 4, axis=1), x.T)
    with pytest.raises(ValueError, match=r"multiple of 2n = 6"):
        reorder_for_load_balance(x, 3)


# ---- The child: the sharded op on 4 devices, each check reported as a JSON line. ----

# name: (mesh shape, mesh axes, axis type, token_axis, head_axis, (Hq, Hkv), load_balance, stats layout, mask)
CASES = {
    "natural_causal_gqa_head_major": ((4,), ("cp",), EXPLICIT, "cp", None, (4, 2), False, "head_major", "causal"),
    "balanced_window_mqa_token_major": ((4,), ("cp",), EXPLICIT, "cp", None, (4, 1), True, "token_major", "window"),
    "natural_no_mask_heads_and_tokens_auto": (
        (2, 2),
        ("heads", "cp"),
        AUTO,
        "cp",
        "heads",
        (4, 2),
        False,
        "token_major",
        "none",
    ),
    "balanced_causal_heads_and_tokens": (
        (2, 2),
        ("heads", "cp"),
        EXPLICIT,
        "cp",
        "heads",
        (4, 2),
        True,
        "head_major",
        "causal",
    ),
}
MASKS = {"causal": dict(is_causal=True), "window": dict(is_causal=True, local_window_size=(6, 0)), "none": {}}


def _check(seed, mesh_shape, mesh_axes, axis_type, token_axis, head_axis, heads, load_balance, layout, mask):
    assert len(jax.devices()) == 4, f"expected 4 virtual devices, got {jax.devices()}"
    mesh = jax.make_mesh(mesh_shape, mesh_axes, axis_types=(axis_type,) * len(mesh_axes))
    n = mesh.shape[token_axis]
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, T, slack=int(rng.integers(1, 7)))
    hq, hkv = heads
    batch = packed_batch(
        rng,
        lengths,
        lengths,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=np.float32,
        slack_q=T - sum(lengths),
        slack_kv=T - sum(lengths),
    )
    options = dict(
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        return_stats=True,
        stats_layout=layout,
        implementation="xla",
        **MASKS[mask],
    )
    stats_axis = 1 if layout == "head_major" else 0
    d_out = jnp.asarray(rng.standard_normal((T, hq, 8)), jnp.float32)
    d_stats = jnp.asarray(rng.standard_normal((T, hq)), jnp.float32)  # token-major; transposed below if need be
    d_stats_layout = d_stats.T if layout == "head_major" else d_stats

    def order(x, axis=0):
        return reorder_for_load_balance(x, n, axis) if load_balance else x

    def forward_and_backward(attention, q, k, v, cu, d_out, d_stats):
        # A vjp rather than a loss: the cotangents reach out and stats as given.
        outputs, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu, cu, **options), q, k, v)
        return (*outputs, *pullback((d_out, d_stats)))

    sharded = functools.partial(
        sharded_ragged_attention, mesh=mesh, token_axis=token_axis, head_axis=head_axis, load_balance=load_balance
    )
    args = (*(order(x) for x in batch.args[:3]), batch.cu_seqlens_q, order(d_out), order(d_stats_layout, stats_axis))
    compiled = jax.jit(functools.partial(forward_and_backward, sharded)).lower(*args).compile()
    got = compiled(*args)
    out, stats = got[:2]
    got = [restore_order(x, n, stats_axis if i == 1 else 0) if load_balance else x for i, x in enumerate(got)]
    unsharded = jax.jit(functools.partial(forward_and_backward, ragged_attention))(
        *batch.args[:4], d_out, d_stats_layout
    )
    reference = reference_attention(
        *batch.reference_args,
        d_out=np.asarray(d_out, np.float64),
        d_stats=np.asarray(d_stats, np.float64),
        max_seqlen_q=batch.max_seqlen_q,
        max_seqlen_kv=batch.max_seqlen_kv,
        **MASKS[mask],
    )
    for i, name in enumerate(("out", "stats", "dq", "dk", "dv")):
        assert_close(got[i], unsharded[i], np.float32, f"{name} against the unsharded op")
        want = reference[name].T if name == "stats" and layout == "head_major" else reference[name]
        assert_close(got[i], want, np.float32, f"{name} against the float64 reference")
        assert float(jnp.abs(jnp.where(jnp.isfinite(want), want, 0)).max()) > 0, f"{name} is all zero"
    np.testing.assert_array_equal(np.asarray(got[0])[batch.padding_q], 0, err_msg="out of padding rows")

    tokens = jax.NamedSharding(mesh, jax.P(token_axis, head_axis, None))
    stats_split = jax.P(head_axis, token_axis) if layout == "head_major" else jax.P(token_axis, head_axis)
    assert out.sharding.is_equivalent_to(tokens, 3), f"out sharding {out.sharding}"
    assert stats.sharding.is_equivalent_to(jax.NamedSharding(mesh, stats_split), 2), f"stats {stats.sharding}"
    hlo = compiled.as_text()
    found = {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in ("all-gather", "reduce-scatter", "all-to-all")}
    # K and V gathered forward, dK and dV reduce-scattered back; q never moves.
    assert found["all-gather"] >= 2 and found["reduce-scatter"] >= 2 and found["all-to-all"] == 0, found
    return found


def _child() -> None:
    report_checks(CASES, lambda seed, name, case: {"collectives": _check(seed, *case)})


def test_sharded_tokens_match_the_unsharded_op_and_the_reference():
    run_checks_in_child(__file__, CASES, timeout=900)


@pytest.mark.parametrize("load_balance", [False, True])
def test_one_device_token_axis_equals_the_op_and_counts_overflow(load_balance):
    """n = 1 in this process: the context-parallel path without collectives, and return_overflow counted
    from the caller's cu_seqlens (the longest document is cut by max_seqlen)."""
    lengths = (21, 0, 9, 30)
    batch = packed_batch(
        np.random.default_rng(3),
        lengths,
        lengths,
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=np.float32,
        slack_q=4,
        slack_kv=4,
    )
    options = dict(
        max_seqlen_q=25, max_seqlen_kv=25, is_causal=True, return_stats=True, return_overflow=True, implementation="xla"
    )
    mesh = jax.make_mesh((1,), ("cp",))
    got = jax.jit(
        functools.partial(sharded_ragged_attention, mesh=mesh, token_axis="cp", load_balance=load_balance, **options)
    )(*batch.args)
    want = jax.jit(functools.partial(ragged_attention, **options))(*batch.args)
    for name, a, b in zip(("out", "stats"), got[:2], want[:2]):
        # The cut document's rows read NaN in both (docs/API.md, "What can be dropped").
        nan = np.isnan(np.asarray(b))
        np.testing.assert_array_equal(np.isnan(np.asarray(a)), nan, err_msg=name)
        assert nan.any(), name
        assert_close(np.where(nan, 0, a), np.where(nan, 0, b), np.float32, name)
    assert jax.tree.map(int, got[2]) == jax.tree.map(int, want[2]) and int(got[2].truncated_rows_q) == 5


# ---- Bad input: validation needs only the axis sizes (an abstract mesh). ----


def _args(total=T, lengths=(30, 20, 10)):
    batch = packed_batch(
        np.random.default_rng(0),
        lengths,
        lengths,
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=np.float32,
        slack_q=total - sum(lengths),
        slack_kv=total - sum(lengths),
    )
    return batch.args, dict(max_seqlen_q=30, max_seqlen_kv=30)


MESH = jax.sharding.AbstractMesh((4,), ("cp",))


@pytest.mark.parametrize("total, load_balance, need", [(66, False, "n = 4"), (68, True, r"2n = 8")])
def test_token_axis_must_divide_the_capacity(total, load_balance, need):
    args, options = _args(total)
    with pytest.raises(ValueError, match=rf"T = {total} must be a multiple of {need}.*token_axis 'cp'"):
        sharded_ragged_attention(*args, mesh=MESH, token_axis="cp", load_balance=load_balance, **options)


def test_unknown_token_axis_raises():
    args, options = _args()
    with pytest.raises(ValueError, match=r"token_axis must name axes of the mesh \('cp',\), got 'tokens'"):
        sharded_ragged_attention(*args, mesh=MESH, token_axis="tokens", **options)


@pytest.mark.parametrize("mask", [dict(local_window_size=(3, 2)), dict(local_window_size=4)])
def test_windows_reaching_right_of_the_diagonal_are_not_implemented(mask):
    args, options = _args()
    with pytest.raises(NotImplementedError, match=r"without is_causal: context parallelism serves no mask, causal"):
        sharded_ragged_attention(*args, mesh=MESH, token_axis="cp", **options, **mask)


def test_cross_attention_shapes_raise():
    (q, k, v, cu, _), options = _args()
    with pytest.raises(ValueError, match=r"self-attention: q, k and v must share the capacity T"):
        sharded_ragged_attention(q, k[:32], v[:32], cu, cu, mesh=MESH, token_axis="cp", **options)
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_kv must be equal"):
        sharded_ragged_attention(q, k, v, cu, cu.at[1].set(29), mesh=MESH, token_axis="cp", **options)
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_kv must be the same \[B \+ 1\] array"):
        sharded_ragged_attention(q, k, v, cu, cu[:-1], mesh=MESH, token_axis="cp", **options)
    with pytest.raises(NotImplementedError, match=r"max_seqlen_q=30 != max_seqlen_kv=31"):
        sharded_ragged_attention(q, k, v, cu, cu, mesh=MESH, token_axis="cp", max_seqlen_q=30, max_seqlen_kv=31)


def test_load_balance_needs_a_token_axis():
    args, options = _args()
    with pytest.raises(ValueError, match=r"load_balance=True balances the token axis: it needs token_axis"):
        sharded_ragged_attention(*args, mesh=MESH, head_axis="cp", load_balance=True, **options)


def test_same_axis_for_heads_and_tokens_raises():
    args, options = _args()
    with pytest.raises(ValueError, match=r"must name different mesh axes"):
        sharded_ragged_attention(*args, mesh=MESH, head_axis="cp", token_axis="cp", **options)


if __name__ == "__main__":
    _child()


# ---- On GPUs: CP=2 on the cuDNN path against one GPU. ----


@pytest.mark.gpu
@pytest.mark.parametrize("context_strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("load_balance", [False, True])
def test_two_gpus_cudnn_context_parallel_matches_one_gpu(load_balance, context_strategy):
    """bf16, causal GQA 16/4, d 128: CP=2 on the cuDNN path equals the unsharded cuDNN call (the same
    arithmetic per row up to the order of a few reductions) and the float64 reference, gradients and a
    stats cotangent included."""
    gpus = cudnn_gpus(2)
    mesh = jax.make_mesh((2,), ("cp",), axis_types=(EXPLICIT,), devices=gpus[:2])
    rng = np.random.default_rng(12)
    lengths = (300, 0, 1100, 64, 517, 9)  # 1100 crosses both balanced chunk edges; tail padding follows
    total = 2048
    batch = packed_batch(
        rng,
        lengths,
        lengths,
        num_heads_q=16,
        num_heads_kv=4,
        head_dim_qk=128,
        head_dim_v=128,
        dtype="bfloat16",
        slack_q=total - sum(lengths),
        slack_kv=total - sum(lengths),
    )
    options = dict(max_seqlen_q=1100, max_seqlen_kv=1100, is_causal=True, return_stats=True, implementation="cudnn")
    d_out = rng.standard_normal((total, 16, 128)).astype("bfloat16")
    d_out[sum(lengths) :] = 0
    d_stats = rng.standard_normal((16, total)).astype(np.float32)

    def order(x, axis=0):
        return reorder_for_load_balance(x, 2, axis) if load_balance else x

    def forward_and_backward(attention, q, k, v, cu, d_out, d_stats):
        outputs, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu, cu, **options), q, k, v)
        return (*outputs, *pullback((d_out, d_stats)))

    sharded = functools.partial(
        sharded_ragged_attention,
        mesh=mesh,
        token_axis="cp",
        load_balance=load_balance,
        context_strategy=context_strategy,
    )
    args = (
        *(order(x) for x in batch.args[:3]),
        batch.cu_seqlens_q,
        order(jnp.asarray(d_out)),
        order(jnp.asarray(d_stats), 1),
    )
    got = jax.jit(functools.partial(forward_and_backward, sharded))(*args)
    got = [restore_order(x, 2, 1 if i == 1 else 0) if load_balance else x for i, x in enumerate(got)]
    one_gpu = jax.jit(functools.partial(forward_and_backward, ragged_attention))(
        *batch.args[:4], jnp.asarray(d_out), jnp.asarray(d_stats)
    )
    expected = reference_attention(
        *batch.reference_args,
        d_out=d_out.astype(np.float64),
        d_stats=d_stats.T.astype(np.float64),
        max_seqlen_q=1100,
        max_seqlen_kv=1100,
        is_causal=True,
    )
    for i, name in enumerate(("out", "stats", "dq", "dk", "dv")):
        # bf16 tolerances for stats too: they are float32 results of bf16 inputs and bf16 matmuls.
        assert_close(
            np.asarray(got[i], np.float64), np.asarray(one_gpu[i], np.float64), "bfloat16", f"{name} against one GPU"
        )
        want = expected[name].T if name == "stats" else expected[name]
        assert_close(np.asarray(got[i], np.float64), want, "bfloat16", f"{name} against the float64 reference")


def _skip_unless_available(implementation: str) -> None:
    """FA3's providers are optional wheels (dew-flash-attn: the one implementation="fa3" takes where installed)."""
    from jax_ragged_attn.backends.fa3 import dew
    from jax_ragged_attn.backends.fa3 import ragged as fa3

    reason = {"flash-attn3-jax": fa3.unavailable_reason, "dew-flash-attn": dew.unavailable_reason}.get(
        implementation, lambda: None
    )()
    if reason:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("implementation, head_dim", [("cudnn", 64), ("flash-attn3-jax", 128), ("dew-flash-attn", 128)])
@pytest.mark.parametrize("n, load_balance", [(2, False), (4, True), (2, True)])
@pytest.mark.parametrize("layout", ["head_major", "token_major"])
def test_one_gpu_device_calls_match_the_op(implementation, head_dim, n, load_balance, layout):
    """Every device's call as the sharded op runs it, on one GPU (_check_device_calls): offset pieces take the
    cuDNN path's split bottom-right backward (rectangle + square), or FA3's bottom-right mask."""
    gpu = cudnn_gpus(1)[0]
    _skip_unless_available(implementation)
    _check_device_calls(implementation, head_dim, n, load_balance, layout, gpu)


@some_fast(
    {"n, load_balance": [(2, False), (4, True), (2, True)], "is_causal": {"causal": True, "no_mask": False}},
    fast=["2-False-causal", "4-True-no_mask"],
)
def test_device_calls_match_the_op_on_the_xla_path(n, load_balance, is_causal):
    _check_device_calls("xla", 32, n, load_balance, "head_major", jax.devices()[0], is_causal=is_causal)


# 1100 crosses chunk edges: offset pieces with keys before them.
FIXED_LENGTHS = (300, 0, 1100, 64, 517, 9)


def _random_packing(seed: int, total: int) -> tuple[tuple[int, ...], int]:
    """(lengths, max_seqlen) of a random packing of at most `total` rows: 3 to 12 documents, some empty, some
    long enough to reach across several chunks (and both of a device's), and half the time a max_seqlen that
    cuts the longest ones (their tails are padding the op must not read)."""
    rng = np.random.default_rng(1000 + seed)
    count = int(rng.integers(3, 13))
    lengths = rng.integers(0, total // 2, count)
    lengths[rng.random(count) < 0.2] = 0
    lengths = np.floor(lengths * min(1.0, (total - int(rng.integers(0, 64))) / max(lengths.sum(), 1))).astype(int)
    longest = max(int(lengths.max()), 1)
    max_seqlen = longest if seed % 2 == 0 else max(1, int(longest * rng.uniform(0.4, 0.9)))
    return tuple(int(x) for x in lengths), max_seqlen


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("implementation, head_dim", [("cudnn", 64), ("flash-attn3-jax", 128), ("dew-flash-attn", 128)])
@pytest.mark.parametrize("n", [4, 8])
def test_one_gpu_device_calls_on_random_packings(implementation, head_dim, n, seed):
    """As above, load-balanced, on random packings (_random_packing): pieces of one document in both of a
    device's chunks, empty documents and chunks, max_seqlen cutting documents."""
    gpu = cudnn_gpus(1)[0]
    _skip_unless_available(implementation)
    lengths, max_seqlen = _random_packing(seed, 2048)
    _check_device_calls(
        implementation,
        head_dim,
        n,
        True,
        "head_major" if seed % 2 else "token_major",
        gpu,
        lengths=lengths,
        max_seqlen=max_seqlen,
        seed=seed,
    )


@some_fast({"seed": range(3)}, fast=["0"])  # random packings through every device's call
def test_device_calls_on_random_packings_on_the_xla_path(seed):
    lengths, max_seqlen = _random_packing(seed, 512)
    _check_device_calls(
        "xla", 16, 4, True, "head_major", jax.devices()[0], lengths=lengths, max_seqlen=max_seqlen, seed=seed, total=512
    )


def _check_device_calls(
    implementation,
    head_dim,
    n,
    load_balance,
    layout,
    device,
    *,
    is_causal=True,
    lengths=FIXED_LENGTHS,
    max_seqlen=1100,
    seed=None,
    total=2048,
):
    """Every device's call as the sharded op runs it (context_parallel.device_chunks_attention against all the
    keys), on one device: with load_balance a device's two chunks are one call over their two key windows side
    by side, each chunk's first piece possibly offset (keys before its queries). Their rows together equal
    the unsharded call and the float64 reference, a stats cotangent included."""
    from jax_ragged_attn.config import AttentionOptions
    from jax_ragged_attn.ops.ragged import attend
    from jax_ragged_attn.parallel import context_parallel as cp
    from jax_ragged_attn.parallel.load_balance import dual_chunk_order

    rng = np.random.default_rng(21 + n if seed is None else 7000 + seed)
    hq, stats_axis = 8, 1 if layout == "head_major" else 0
    batch = packed_batch(
        rng,
        lengths,
        lengths,
        num_heads_q=hq,
        num_heads_kv=2,
        head_dim_qk=head_dim,
        head_dim_v=head_dim,
        dtype="bfloat16",
        slack_q=total - sum(lengths),
        slack_kv=total - sum(lengths),
    )
    plan = cp.Plan(
        token_axis="cp",
        devices=n,
        load_balance=load_balance,
        max_seqlen=max_seqlen,
        is_causal=is_causal,
        window_left=None,
        stats_axis=stats_axis,
    )
    options = AttentionOptions(
        is_causal=is_causal, stats_layout=layout, return_stats=True, **implementation_options(implementation)
    )

    def attend_chunk(q, k, v, cu_q, cu_kv, max_seqlen_q, max_seqlen_kv, *, seqused, diagonal_alignment):
        chunk_options = dataclasses.replace(options, diagonal_alignment=diagonal_alignment)
        return attend(
            (q, k, v),
            cu_q,
            cu_kv,
            chunk_options,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_kv=max_seqlen_kv,
            seqused_q=seqused[0],
            seqused_kv=seqused[1],
        )

    def by_device(q, k, v, cu):
        # The devices' shards in the dual-chunk order (device r: chunks r, 2n-1-r), each its own call; the
        # results come back in that order and are put back in the natural one.
        order = dual_chunk_order(n) if load_balance else list(range(n))
        rows = total // len(order)
        per_device = plan.chunks_per_device
        outs, stats = [None] * len(order), [None] * len(order)
        for r in range(n):
            ids = order[r * per_device : (r + 1) * per_device]
            q_device = jnp.concatenate([q[c * rows : (c + 1) * rows] for c in ids])
            out, s = cp.device_chunks_attention(plan, attend_chunk, q_device, k, v, cu, r)
            for j, c in enumerate(ids):
                outs[c] = out[j * rows : (j + 1) * rows]
                stats[c] = lax.slice_in_dim(s, j * rows, (j + 1) * rows, axis=stats_axis)
        return jnp.concatenate(outs), jnp.concatenate(stats, axis=stats_axis)

    def unsharded(q, k, v, cu):
        return ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            is_causal=is_causal,
            return_stats=True,
            stats_layout=layout,
            **implementation_options(implementation),
        )

    # Rows of a document longer than max_seqlen: the op reads NaN there (ops/common.loud; the sharded op selects
    # over the caller's rows after the device calls, parallel/sharding.py), so they are compared as NaN in the
    # one call and left out of the device calls' comparison, and no cotangent reaches them on either side.
    cut = np.zeros(total, bool)
    cut[: sum(lengths)] = np.repeat(np.asarray(lengths) > max_seqlen, lengths)
    d_out = rng.standard_normal((total, hq, head_dim)).astype("bfloat16")
    d_out[sum(lengths) :] = 0
    d_out[cut] = 0
    d_stats = rng.standard_normal((total, hq)).astype(np.float32)
    d_stats[cut] = 0
    d_stats_layout = jnp.asarray(d_stats.T if layout == "head_major" else d_stats)

    def forward_and_backward(attention, q, k, v, cu):
        outputs, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu), q, k, v)
        return (*outputs, *pullback((jnp.asarray(d_out), d_stats_layout)))

    args = jax.device_put(batch.args[:4], device)
    got = jax.jit(functools.partial(forward_and_backward, by_device))(*args)
    one_call = jax.jit(functools.partial(forward_and_backward, unsharded))(*args)
    expected = reference_attention(
        *batch.reference_args,
        d_out=d_out.astype(np.float64),
        d_stats=d_stats.astype(np.float64),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        is_causal=is_causal,
    )
    for i, name in enumerate(("out", "stats", "dq", "dk", "dv")):
        mine, theirs = np.asarray(got[i], np.float64), np.asarray(one_call[i], np.float64)
        want = np.asarray(expected[name])
        if name == "stats" and layout == "head_major":  # compared token-major: rows first
            mine, theirs = mine.T, theirs.T
        if name in ("out", "stats"):
            assert np.isnan(theirs[cut]).all(), f"{name}: a cut document's rows must read NaN in one call"
            mine, theirs, want = mine[~cut], theirs[~cut], want[~cut]
        assert_close(mine, theirs, "bfloat16", f"{name} against one call")
        assert_close(mine, want, "bfloat16", f"{name} against the float64 reference")
