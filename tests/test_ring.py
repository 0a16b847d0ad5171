"""The ring strategy of context parallelism (sharded_ragged_attention(..., context_strategy="ring")).

In this process: the pieces of every (device, step, query chunk) and the window pairs' layouts against the
dense segment-causal mask (NumPy, many seeds), the log-sum-exp merge, validation, and the ring on a token
axis of one device. In a child interpreter with 4 virtual CPU devices (this file run as a script, as
tests/test_context_parallel.py does): the ring against all_gather, the unsharded op and the float64
reference - out, stats in both layouts, dq/dk/dv with a stats cotangent - and its compiled HLO, each check
printing one JSON line. Reproduce by hand with
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu RING_TEST_GROUP=masks python tests/test_ring.py
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ragged_attn import ragged_attention
from jax_ragged_attn.config import AttentionOptions
from jax_ragged_attn.index import cu_seqlens_from_lengths
from jax_ragged_attn.parallel import ring
from jax_ragged_attn.parallel.context_parallel import Plan
from jax_ragged_attn.parallel.sharding import reorder_for_load_balance, restore_order, sharded_ragged_attention
from jax_ragged_attn.testing import assert_close, packed_batch
from jax_ragged_attn.testing.documents import dense_mask, random_document_lengths
from jax_ragged_attn.testing.multidevice import cudnn_gpus, report_checks, run_checks_in_child
from jax_ragged_attn.testing.reference import reference_attention

pytestmark = pytest.mark.slow  # 4-device children: the ring against all-gather, masks and meshes

EXPLICIT, AUTO = jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto


def random_lengths(rng, total: int, *, slack: int) -> list[int]:
    return random_document_lengths(rng, total, slack=slack, longest=(total // 3, total // 2))


def op_mask(
    cu_seqlens_q,
    cu_seqlens_kv,
    rows: int,
    cols: int,
    *,
    is_causal: bool,
    window=None,
    alignment="bottom_right",
    seqused_q=None,
    seqused_kv=None,
) -> np.ndarray:
    """[rows, cols] bool: what the op attends for these arguments (ragged_attention's documented semantics,
    spelled out again): sequence b's queries are the first seqused_q[b] rows of its slot (all of it without
    seqused), its keys likewise; diagonal d = i (top-left) or i + skv - sq (bottom-right, used lengths);
    window (left, right) keeps d - left <= j <= d + right."""
    cu_q, cu_kv = np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_kv)
    used_q = np.diff(cu_q) if seqused_q is None else np.minimum(np.asarray(seqused_q), np.diff(cu_q))
    used_kv = np.diff(cu_kv) if seqused_kv is None else np.minimum(np.asarray(seqused_kv), np.diff(cu_kv))
    mask = np.zeros((rows, cols), bool)
    for b in range(len(cu_q) - 1):
        sq, skv = int(used_q[b]), int(used_kv[b])
        d = np.arange(sq)[:, None] + (skv - sq if alignment == "bottom_right" else 0)
        j = np.arange(skv)[None, :]
        keep = np.ones((sq, skv), bool)
        if is_causal:
            keep &= j <= d
        if window is not None:
            keep &= (j >= d - window[0]) & (j <= d + window[1])
        assert not mask[cu_q[b] : cu_q[b] + sq, cu_kv[b] : cu_kv[b] + skv].any(), "two sequences share rows"
        mask[cu_q[b] : cu_q[b] + sq, cu_kv[b] : cu_kv[b] + skv] = keep
    return mask


def pieces_mask(pieces, rows: int, cols: int, **mask) -> np.ndarray:
    """op_mask of pieces as the ring passes them to the op (ring.pieces_arguments)."""
    arguments = {name: np.asarray(x) for name, x in ring.pieces_arguments(pieces, rows, cols).items()}
    return op_mask(arguments.pop("cu_seqlens_q"), arguments.pop("cu_seqlens_kv"), rows, cols, **mask, **arguments)


def chunk_ids(device: int, n: int, load_balance: bool) -> list[int]:
    """The natural chunks a device holds: [r] of n, or [r, 2n-1-r] of 2n."""
    return [device, 2 * n - 1 - device] if load_balance else [device]


def make_ring(n: int, load_balance: bool, total: int, max_seqlen: int, is_causal: bool, window) -> ring._Ring:
    plan = Plan(
        token_axis="cp",
        devices=n,
        load_balance=load_balance,
        max_seqlen=max_seqlen,
        is_causal=is_causal,
        window_left=window,
        stats_axis=0,
    )
    rows = total // (2 * n if load_balance else n)
    return ring._Ring(plan=plan, options=AttentionOptions(), chunk_rows=rows, window=window)


def batch_cu(seed: int, total: int, entries: int = 24):
    """(cu_seqlens, max_seqlen) of random documents, with zero-length documents appended up to `entries`
    entries: one shape for every seed, so the eager calls below reuse their compiled kernels."""
    rng = np.random.default_rng(seed)
    lengths = random_lengths(rng, total, slack=int(rng.integers(0, 7)))
    max_seqlen = int(rng.choice([max(lengths), max(lengths) - 3]))  # sometimes cutting the longest document
    return cu_seqlens_from_lengths(lengths + [0] * (entries - 1 - len(lengths))), max_seqlen


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("total", [64, 40])
@pytest.mark.parametrize("n, load_balance", [(2, False), (4, False), (2, True), (4, True)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_every_step_attends_exactly_the_dense_mask(seed, total, n, load_balance, is_causal):
    """For every device r and step s (the shard of device r - s visiting), the calls a query chunk makes (as
    ring._step makes them) attend exactly the dense mask's entries between its rows and the shard's rows:
    the steps partition the mask."""
    cu, max_seqlen = batch_cu(seed, total)
    want = dense_mask(cu, total, max_seqlen, is_causal, None)
    c = total // (2 * n if load_balance else n)
    for r in range(n):
        for s in range(n):
            shard = chunk_ids((r - s) % n, n, load_balance)
            shard_rows = np.concatenate([np.arange(i * c, (i + 1) * c) for i in shard])
            for chunk in chunk_ids(r, n, load_balance):
                got = np.zeros((c, len(shard_rows)), bool)
                if s == 0 and is_causal:  # each shard chunk its own call: itself causal, an earlier one whole
                    calls = [(i, [i], dict(is_causal=i == chunk, alignment="top_left")) for i in shard if i <= chunk]
                else:  # one call against the whole shard, without a mask
                    calls = [(shard[0], shard, dict(is_causal=False))]
                for first, chunks, mask in calls:
                    pieces = ring.block_pieces(
                        jnp.asarray(cu),
                        jnp.int32(chunk * c),
                        c,
                        [jnp.int32(i * c) for i in chunks],
                        c,
                        max_seqlen=max_seqlen,
                        keys_up_to_queries=is_causal,
                    )
                    kv_start, kv_len = np.asarray(pieces.kv_start), np.asarray(pieces.kv_len)
                    assert np.all(kv_start[1:] >= kv_start[:-1] + kv_len[:-1]), "key runs overlap or descend"
                    offset = shard.index(first) * c
                    block = pieces_mask(pieces, c, len(chunks) * c, **mask)
                    assert not (got[:, offset : offset + block.shape[1]] & block).any(), "a key attended twice"
                    got[:, offset : offset + block.shape[1]] |= block
                np.testing.assert_array_equal(
                    got,
                    want[chunk * c : (chunk + 1) * c][:, shard_rows],
                    err_msg=f"device {r}, step {s}, query chunk {chunk}",
                )


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("total", [64, 40])
@pytest.mark.parametrize("n, load_balance", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize(
    "chunks_and_rows",
    [(0, 0), (0, 3), (1, -1), (1, 0), (1, 1), (2, 3), (0, 100)],
    ids=["0", "3", "C-1", "C", "C+1", "2C+3", "100"],
)
def test_window_pairs_attend_exactly_the_dense_mask(seed, total, n, load_balance, chunks_and_rows):
    """Causal with a left window: every pair of natural chunks (query chunk, key chunk), laid out as the ring
    lays it out - the diagonal as identical runs, another chunk through window_layout / window_band with the
    query rows past the crossing run masked - attends exactly the dense windowed mask there."""
    cu, max_seqlen = batch_cu(seed, total)
    chunks = 2 * n if load_balance else n
    c = total // chunks
    left = chunks_and_rows[0] * c + chunks_and_rows[1]  # the left window: (1, -1) is C - 1
    want = dense_mask(cu, total, max_seqlen, True, left)
    layout = make_ring(n, load_balance, total, max_seqlen, True, left)
    for qc in range(chunks):
        for kc in range(chunks):
            block = want[qc * c : (qc + 1) * c, kc * c : (kc + 1) * c]
            if qc == kc:
                pieces = ring.block_pieces(
                    jnp.asarray(cu),
                    jnp.int32(qc * c),
                    c,
                    [jnp.int32(qc * c)],
                    c,
                    max_seqlen=max_seqlen,
                    keys_up_to_queries=True,
                )
                got = pieces_mask(pieces, c, c, is_causal=True, window=(left, 0), alignment="top_left")
            else:
                branch, run, kv0, kv_end = (
                    int(x) for x in ring.window_layout(layout, jnp.asarray(cu), jnp.int32(qc * c), jnp.int32(kc * c))
                )
                got = np.zeros((c, c), bool)
                if branch:
                    assert branch == qc - kc, (branch, qc, kc)
                    sq, op_left = ring.window_band(layout, branch)
                    got = op_mask(
                        [0, c],
                        [kv0, c],
                        c,
                        c,
                        is_causal=False,
                        window=(op_left, c),
                        seqused_q=[sq],
                        seqused_kv=[kv_end - kv0],
                    )
                    got[run:] = False  # the rows past the crossing sequence's run are masked after the call
            np.testing.assert_array_equal(got, block, err_msg=f"query chunk {qc}, key chunk {kc}, window {left}")
    if not load_balance:  # the natural order takes only the steps the window reaches
        reach = max(
            (
                qc - kc
                for qc in range(chunks)
                for kc in range(qc)
                if want[qc * c : (qc + 1) * c, kc * c : (kc + 1) * c].any()
            ),
            default=0,
        )
        assert reach + 1 <= layout.steps <= n


def test_merge_is_the_exact_logsumexp_and_never_nan():
    rng = np.random.default_rng(0)
    rows, heads, dim = 6, 2, 3
    out_a, out_b = (jnp.asarray(rng.standard_normal((rows, heads, dim)), jnp.float32) for _ in range(2))
    lse_a = jnp.asarray(rng.standard_normal((rows, heads)) * 3, jnp.float32)
    lse_b = jnp.asarray(rng.standard_normal((rows, heads)) * 3, jnp.float32)
    # Row 0: no key on side a; row 1: none on b; row 2: none on either (out 0 there, as the op reads).
    lse_a = lse_a.at[0].set(-jnp.inf).at[2].set(-jnp.inf)
    lse_b = lse_b.at[1].set(-jnp.inf).at[2].set(-jnp.inf)
    out_a, out_b = out_a.at[0].set(0).at[2].set(0), out_b.at[1].set(0).at[2].set(0)
    out, lse = jax.jit(ring.merge_partials)(out_a, lse_a, out_b, lse_b)
    a, b = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
    want_lse = np.logaddexp(a, b)
    with np.errstate(invalid="ignore"):
        w_a = np.where(np.isfinite(a), np.exp(a - want_lse), 0)[..., None]
        w_b = np.where(np.isfinite(b), np.exp(b - want_lse), 0)[..., None]
    want_out = np.nan_to_num(w_a) * np.asarray(out_a) + np.nan_to_num(w_b) * np.asarray(out_b)
    assert_close(lse, want_lse, np.float32, "lse")
    assert_close(out, want_out, np.float32, "out")
    np.testing.assert_array_equal(np.asarray(out[2]), 0)

    def loss(out_a, lse_a, out_b, lse_b):
        out, lse = ring.merge_partials(out_a, lse_a, out_b, lse_b)
        return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(out_a, lse_a, out_b, lse_b)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads), "the merge's gradient holds NaN or inf"


MESH = jax.sharding.AbstractMesh((4,), ("cp",))


def _args(total=64, lengths=(30, 20, 10)):
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


def test_unknown_context_strategy_raises():
    args, options = _args()
    with pytest.raises(ValueError, match=r"context_strategy must be one of \('all_gather', 'ring'\), got 'rings'"):
        sharded_ragged_attention(*args, mesh=MESH, token_axis="cp", context_strategy="rings", **options)


def test_ring_needs_a_token_axis():
    args, options = _args()
    with pytest.raises(ValueError, match=r"context_strategy='ring' rotates K/V over the token axis: it needs"):
        sharded_ragged_attention(*args, mesh=MESH, head_axis="cp", context_strategy="ring", **options)


@pytest.mark.parametrize("load_balance", [True])
def test_one_device_ring_equals_the_op(load_balance):
    """n = 1 in this process: the ring without collectives (one step), forward and a vjp with a stats
    cotangent, against the unsharded op."""
    rng = np.random.default_rng(5)
    lengths = (21, 0, 9, 30)
    batch = packed_batch(
        rng,
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
    options = dict(max_seqlen_q=30, max_seqlen_kv=30, is_causal=True, return_stats=True, implementation="xla")
    d_out = jnp.asarray(rng.standard_normal((64, 4, 8)), jnp.float32)
    d_stats = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    mesh = jax.make_mesh((1,), ("cp",))
    sharded = functools.partial(
        sharded_ragged_attention, mesh=mesh, token_axis="cp", load_balance=load_balance, context_strategy="ring"
    )
    got = jax.jit(functools.partial(_forward_and_backward, sharded, options))(*batch.args[:4], d_out, d_stats)
    want = jax.jit(functools.partial(_forward_and_backward, ragged_attention, options))(*batch.args[:4], d_out, d_stats)
    for name, a, b in zip(("out", "stats", "dq", "dk", "dv"), got, want):
        assert_close(a, b, np.float32, name)


def _forward_and_backward(attention, options, q, k, v, cu, d_out, d_stats):
    # A vjp rather than a loss: the cotangents reach out and stats as given.
    outputs, pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu, cu, **options), q, k, v)
    return (*outputs, *pullback((d_out, d_stats)))


# ---- The child: the ring on 4 devices, each check reported as a JSON line. ----

MASKS = {
    "causal": dict(is_causal=True),
    "window": dict(is_causal=True, local_window_size=(6, 0)),
    "long_window": dict(is_causal=True, local_window_size=(20, 0)),
    "none": {},
}
# name: (T, mesh shape, mesh axes, axis type, head_axis, (Hq, Hkv), load_balance, stats layout, mask, cut)
# token_axis is "cp" throughout; cut: max_seqlen 3 below the longest document, which the op then truncates.
GROUPS = {
    "masks": {
        "natural_causal_gqa_head_major": (
            64,
            (4,),
            ("cp",),
            EXPLICIT,
            None,
            (4, 2),
            False,
            "head_major",
            "causal",
            False,
        ),
        "balanced_window_mqa_token_major_cut": (
            64,
            (4,),
            ("cp",),
            EXPLICIT,
            None,
            (4, 1),
            True,
            "token_major",
            "window",
            True,
        ),
        "natural_long_window_head_major": (
            40,
            (4,),
            ("cp",),
            EXPLICIT,
            None,
            (2, 2),
            False,
            "head_major",
            "long_window",
            False,
        ),
    },
    "meshes": {
        "natural_no_mask_heads_and_tokens_auto": (
            40,
            (2, 2),
            ("heads", "cp"),
            AUTO,
            "heads",
            (4, 2),
            False,
            "token_major",
            "none",
            False,
        ),
        "balanced_causal_heads_and_tokens_cut": (
            40,
            (2, 2),
            ("heads", "cp"),
            EXPLICIT,
            "heads",
            (4, 2),
            True,
            "head_major",
            "causal",
            True,
        ),
        "memory_ring_below_all_gather": None,
    },
}
GROUP_ENV = "RING_TEST_GROUP"


def _collectives(hlo: str) -> dict:
    return {
        c: len(re.findall(rf"\b{c}(-start)?\(", hlo))
        for c in ("collective-permute", "all-gather", "reduce-scatter", "all-to-all")
    }


def _check(seed, total, mesh_shape, mesh_axes, axis_type, head_axis, heads, load_balance, layout, mask, cut):
    assert len(jax.devices()) == 4, f"expected 4 virtual devices, got {jax.devices()}"
    mesh = jax.make_mesh(mesh_shape, mesh_axes, axis_types=(axis_type,) * len(mesh_axes))
    n = mesh.shape["cp"]
    rng = np.random.default_rng(100 + seed)
    lengths = random_lengths(rng, total, slack=int(rng.integers(1, 7)))
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
        slack_q=total - sum(lengths),
        slack_kv=total - sum(lengths),
    )
    max_seqlen = batch.max_seqlen_q - 3 if cut else batch.max_seqlen_q
    options = dict(
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        return_stats=True,
        stats_layout=layout,
        implementation="xla",
        **MASKS[mask],
    )
    stats_axis = 1 if layout == "head_major" else 0
    d_out = jnp.asarray(rng.standard_normal((total, hq, 8)), jnp.float32)
    d_stats = jnp.asarray(rng.standard_normal((total, hq)), jnp.float32)  # token-major; transposed if need be
    d_stats_layout = d_stats.T if layout == "head_major" else d_stats

    def order(x, axis=0):
        return reorder_for_load_balance(x, n, axis) if load_balance else x

    def natural(results):
        if not load_balance:
            return results
        return [restore_order(x, n, stats_axis if i == 1 else 0) for i, x in enumerate(results)]

    args = (*(order(x) for x in batch.args[:3]), batch.cu_seqlens_q, order(d_out), order(d_stats_layout, stats_axis))
    compiled, seconds = {}, {}
    for strategy in ("ring", "all_gather"):
        sharded = functools.partial(
            sharded_ragged_attention,
            mesh=mesh,
            token_axis="cp",
            head_axis=head_axis,
            load_balance=load_balance,
            context_strategy=strategy,
        )
        start = time.perf_counter()
        compiled[strategy] = jax.jit(functools.partial(_forward_and_backward, sharded, options)).lower(*args).compile()
        seconds[strategy] = round(time.perf_counter() - start, 1)
    got = compiled["ring"](*args)
    out, stats = got[:2]
    got = natural(got)
    gathered = natural(compiled["all_gather"](*args))
    unsharded = jax.jit(functools.partial(_forward_and_backward, ragged_attention, options))(
        *batch.args[:4], d_out, d_stats_layout
    )
    # A cut document's rows read NaN (docs/API.md, "What can be dropped") and pass no cotangent on: the
    # reference gets none there either, and those rows are compared as NaN, the rest as numbers.
    cu = np.asarray(batch.cu_seqlens_q)
    cut_rows = np.zeros(total, bool)
    for start, stop in itertools.pairwise(cu):
        cut_rows[start:stop] = stop - start > max_seqlen
    assert cut_rows.any() == cut
    reference = reference_attention(
        *batch.reference_args,
        d_out=np.where(cut_rows[:, None, None], 0, np.asarray(d_out, np.float64)),
        d_stats=np.where(cut_rows[:, None], 0, np.asarray(d_stats, np.float64)),
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        **MASKS[mask],
    )

    def rows_of(x, i):
        """The cut rows of out (i = 0) or stats (1) as a mask of x's shape; none of a gradient."""
        if i > 1:
            return np.zeros(np.shape(x), bool)
        rows = cut_rows[:, None, None] if i == 0 else (cut_rows[None, :] if stats_axis == 1 else cut_rows[:, None])
        return np.broadcast_to(rows, np.shape(x))

    def numbers(x, i):
        """x with the cut rows, which must all be NaN, made 0."""
        rows = rows_of(x, i)
        assert np.isnan(np.asarray(x, np.float64)[rows]).all(), f"result {i}: a cut row is not NaN"
        return np.where(rows, 0, np.asarray(x, np.float64))

    for i, name in enumerate(("out", "stats", "dq", "dk", "dv")):
        assert_close(numbers(got[i], i), numbers(gathered[i], i), np.float32, f"{name} against all_gather")
        assert_close(numbers(got[i], i), numbers(unsharded[i], i), np.float32, f"{name} against the unsharded op")
        want = reference[name].T if name == "stats" and layout == "head_major" else reference[name]
        want = np.where(rows_of(want, i), 0, want)
        assert_close(numbers(got[i], i), want, np.float32, f"{name} against the float64 reference")
        assert float(jnp.abs(jnp.where(jnp.isfinite(want), want, 0)).max()) > 0, f"{name} is all zero"
    np.testing.assert_array_equal(np.asarray(got[0])[batch.padding_q], 0, err_msg="out of padding rows")

    tokens = jax.NamedSharding(mesh, jax.P("cp", head_axis, None))
    stats_split = jax.P(head_axis, "cp") if layout == "head_major" else jax.P("cp", head_axis)
    assert out.sharding.is_equivalent_to(tokens, 3), f"out sharding {out.sharding}"
    assert stats.sharding.is_equivalent_to(jax.NamedSharding(mesh, stats_split), 2), f"stats {stats.sharding}"
    found = _collectives(compiled["ring"].as_text())
    # K/V (and dK/dV) travel by collective-permute; nothing is gathered or reduce-scattered.
    assert found["collective-permute"] >= 2 and found["all-gather"] == found["reduce-scatter"] == 0, found
    assert found["all-to-all"] == 0, found
    return {"collectives": found, "compile_seconds": seconds}


def _memory(total: int = 4096, heads: int = 2, dim: int = 64) -> dict:
    """Per-device temp bytes of the compiled forward + backward (xla path, bf16, natural order, causal):
    the ring holds the local shard and the blocks in flight, all_gather the whole K/V and its dK/dV."""
    mesh = jax.make_mesh((4,), ("cp",), axis_types=(EXPLICIT,))
    cu = jnp.asarray([0, total // 4, total // 2 + 100, total - 96], jnp.int32)
    x = jax.ShapeDtypeStruct((total, heads, dim), jnp.bfloat16, sharding=jax.NamedSharding(mesh, jax.P("cp")))
    temp = {}
    for strategy in ("ring", "all_gather"):

        def loss(q, k, v):
            out = sharded_ragged_attention(
                q,
                k,
                v,
                cu,
                cu,
                mesh=mesh,
                token_axis="cp",
                context_strategy=strategy,
                max_seqlen_q=total,
                max_seqlen_kv=total,
                is_causal=True,
                implementation="xla",
            )
            return jnp.sum(out.astype(jnp.float32))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        temp[strategy] = int(compiled.memory_analysis().temp_size_in_bytes)
    assert temp["ring"] < 0.8 * temp["all_gather"], temp
    return {"temp_bytes": temp}


def _child() -> None:
    cases = GROUPS[os.environ[GROUP_ENV]]

    def run(seed, name, case):
        if case is None:
            return _memory()
        return _check(seed, *case)

    report_checks(cases, run)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_ring_matches_all_gather_the_op_and_the_reference(group, monkeypatch):
    monkeypatch.setenv(GROUP_ENV, group)
    run_checks_in_child(__file__, GROUPS[group], timeout=900)


if __name__ == "__main__":
    _child()


# ---- On GPUs: the blocks on the cuDNN path. ----


def _simulated_ring(blocks: ring._Ring, n: int, q, k, v, cu):
    """The ring's forward on one device: device r's step-s call (ring._step) for every r and s, merged as the
    ring merges them; q, k, v hold all devices' rows in device order. Autodiff through it differentiates each
    block through its stats, the calls the ring's backward makes."""
    rows = q.shape[0] // n
    outs, lses = [], []
    for r in range(n):
        merged = None
        for s in range(blocks.steps):
            src = (r - s) % n
            part = ring._step(
                blocks,
                s == 0,
                q[r * rows : (r + 1) * rows],
                k[src * rows : (src + 1) * rows],
                v[src * rows : (src + 1) * rows],
                cu,
                jnp.int32(r),
                jnp.int32(src),
            )
            merged = part if merged is None else ring.merge_partials(*merged, *part)
        outs.append(merged[0])
        lses.append(merged[1])
    return jnp.concatenate(outs).astype(q.dtype), jnp.concatenate(lses)


def _vjp(attention, q, k, v, cu, d_out, d_stats):
    """(out, stats, dq, dk, dv) of attention(q, k, v, cu) -> (out, stats) for the cotangents (d_out, d_stats)."""
    (out, stats), pullback = jax.vjp(lambda q, k, v: attention(q, k, v, cu), q, k, v)
    return (out, stats, *pullback((d_out, d_stats)))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "load_balance, mask",
    [(False, "causal"), (True, "causal"), (False, "none"), (False, "window100"), (True, "window300")],
)
def test_ring_blocks_on_cudnn_match_one_call(load_balance, mask):
    """One GPU: every block call of a 4-device ring on the cuDNN path (bf16, GQA 8/2, d 64, T 1024: chunks of
    256 rows, 128 balanced; windows 100 and 300 reach one and three chunks back), merged, against one cuDNN
    call and the float64 reference, gradients and a stats cotangent included. Run on one H200 (cuDNN 9.19)
    for this change: the five cases passed."""
    cudnn_gpus(1)
    total, n, hq, hkv, dim = 1024, 4, 8, 2, 64
    lengths = (300, 0, 410, 64, 117, 9, 40)
    rng = np.random.default_rng(3)
    batch = packed_batch(
        rng,
        lengths,
        lengths,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim_qk=dim,
        head_dim_v=dim,
        dtype="bfloat16",
        slack_q=total - sum(lengths),
        slack_kv=total - sum(lengths),
    )
    masks = {
        "causal": dict(is_causal=True),
        "none": {},
        "window100": dict(is_causal=True, local_window_size=(100, 0)),
        "window300": dict(is_causal=True, local_window_size=(300, 0)),
    }
    left = masks[mask].get("local_window_size", (None,))[0]
    longest = max(lengths)
    plan = Plan(
        token_axis="cp",
        devices=n,
        load_balance=load_balance,
        max_seqlen=longest,
        is_causal=bool(masks[mask]),
        window_left=left,
        stats_axis=0,
    )
    options = AttentionOptions(implementation="cudnn", return_stats=True, stats_layout="token_major", check=False)
    blocks = ring._Ring(plan=plan, options=options, chunk_rows=total // (2 * n if load_balance else n), window=left)
    d_out = rng.standard_normal((total, hq, dim)).astype("bfloat16")
    d_out[sum(lengths) :] = 0
    d_stats = rng.standard_normal((total, hq)).astype(np.float32)

    def order(x):
        return reorder_for_load_balance(x, n) if load_balance else x

    got = jax.jit(lambda q, k, v, cu, do, ds: _vjp(functools.partial(_simulated_ring, blocks, n), q, k, v, cu, do, ds))(
        *(order(x) for x in batch.args[:3]), batch.cu_seqlens_q, order(jnp.asarray(d_out)), order(jnp.asarray(d_stats))
    )
    got = [restore_order(x, n) if load_balance else x for x in got]
    call = dict(
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        return_stats=True,
        stats_layout="token_major",
        implementation="cudnn",
        **masks[mask],
    )
    one = jax.jit(functools.partial(_forward_and_backward, ragged_attention, call))(
        *batch.args[:4], jnp.asarray(d_out), jnp.asarray(d_stats)
    )
    expected = reference_attention(
        *batch.reference_args,
        d_out=d_out.astype(np.float64),
        d_stats=d_stats.astype(np.float64),
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        **masks[mask],
    )
    for i, name in enumerate(("out", "stats", "dq", "dk", "dv")):
        assert_close(np.asarray(got[i], np.float64), np.asarray(one[i], np.float64), "bfloat16", f"{name}, one call")
        assert_close(np.asarray(got[i], np.float64), expected[name], "bfloat16", f"{name}, reference")
