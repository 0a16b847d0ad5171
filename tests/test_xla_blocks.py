"""The blocked xla path against the float64 reference with blocks smaller than the sequences.

At the default 128-row blocks every test batch fits in one tile, so the online softmax, the tile ranges and
the backward (fused on the CPU; its two-pass form, a GPU's default, has a test of its own) would only ever
see one step. Here blocks of 1 to 5 rows make every sequence span
several tiles, tiles straddle sequence boundaries, and the last tile of a range is partial. Blocks are set
through ragged_attention's xla_block_size, the user's knob, which enters the static config.

Each case draws fresh inputs from a seed derived from its test id (`pytest tests/test_xla_blocks.py -k '<id>'`
reproduces it); padding rows are NaN-poisoned and their cotangents are random, so a leak shows.
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
from jax_ragged_attn.backends.xla import memory as xla_memory
from jax_ragged_attn.config import AttentionOptions, make_config
from jax_ragged_attn.ops import common
from jax_ragged_attn.testing import assert_close, packed_batch, random_lengths
from jax_ragged_attn.testing.private_config import backend_options
from jax_ragged_attn.testing.reference import reference_attention

pytestmark = pytest.mark.slow  # 1-5 row tiles of the xla path (its semantics: test_semantics.py's XlaTest, fast)


@dataclasses.dataclass(frozen=True)
class Case:
    seqlens_q: tuple[int, ...]
    seqlens_kv: tuple[int, ...] | None = None  # None: same as seqlens_q
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    dims: tuple[int, int] = (8, 8)  # (Dqk, Dv)
    is_causal: bool = False
    diagonal_alignment: str = "top_left"
    local_window_size: int | tuple[int, int] | None = None
    slack: tuple[int, int] = (3, 2)  # capacity padding rows of q and of k/v
    max_seqlen: tuple[int, int] | None = None  # None: the longest sequences; smaller cuts sequences
    sinks: bool = False

    def options(self) -> dict:
        return dict(
            is_causal=self.is_causal,
            diagonal_alignment=self.diagonal_alignment,
            local_window_size=self.local_window_size,
        )


CASES = {
    "mha": Case((5, 3, 7), heads=(2, 2)),
    "empty_first_middle_last": Case((0, 4, 0, 6, 0), (0, 5, 0, 3, 0)),
    "empty_kv_only": Case((3, 4, 2), (0, 5, 0)),
    "all_empty": Case((0, 0), (0, 0)),
    "no_capacity_padding": Case((4, 6), (5, 2), slack=(0, 0)),
    "gqa_causal": Case((5, 7, 2), heads=(6, 2), is_causal=True),
    "mqa_causal_bottom_right": Case(
        (3, 6, 4), (7, 4, 4), heads=(4, 1), is_causal=True, diagonal_alignment="bottom_right"
    ),
    "bottom_right_window": Case((6, 2), (3, 7), local_window_size=2, diagonal_alignment="bottom_right"),
    "window_tuple_causal": Case((8, 3), (6, 5), local_window_size=(3, 1), is_causal=True),
    "window_asymmetric_bottom_right_causal": Case(
        (4, 7), (6, 3), local_window_size=(0, 2), is_causal=True, diagonal_alignment="bottom_right"
    ),
    "window_right_only": Case((6, 5), local_window_size=(9, 0)),
    "dv_differs_gqa": Case((4, 6), (7, 3), heads=(6, 3), dims=(8, 24)),
    "cut_by_max_seqlen": Case(
        (6, 2, 5), (3, 7, 4), is_causal=True, diagonal_alignment="bottom_right", max_seqlen=(4, 5)
    ),
    "sinks_gqa_bottom_right": Case(
        (6, 0, 9, 5), (8, 0, 4, 5), is_causal=True, diagonal_alignment="bottom_right", sinks=True
    ),
    "long_and_short": Case((17, 1, 2, 11), (13, 3, 1, 16), heads=(2, 1), local_window_size=(5, 2)),
}
# (block_q, block_kv): unequal, one-row and wider-than-some-sequences tiles.
BLOCKS = [(3, 2), (1, 5), (4, 4)]
PARAMS = [
    pytest.param(name, "float32", BLOCKS[i % len(BLOCKS)], id=f"{name}-float32-{BLOCKS[i % len(BLOCKS)]}")
    for i, name in enumerate(CASES)
]
PARAMS += [
    pytest.param(name, dtype, (2, 3), id=f"{name}-{dtype}-(2, 3)")
    for name in ("mqa_causal_bottom_right", "window_tuple_causal", "sinks_gqa_bottom_right")
    for dtype in ("bfloat16", "float16")
]


@pytest.fixture
def rng(request) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def _run_case(rng, case: Case, dtype: str, blocks, layout: str, **private):
    """private: the backend options to set (testing.backend_options), e.g. xla_fused_backward."""
    seqlens_kv = case.seqlens_q if case.seqlens_kv is None else case.seqlens_kv
    batch = packed_batch(
        rng,
        case.seqlens_q,
        seqlens_kv,
        num_heads_q=case.heads[0],
        num_heads_kv=case.heads[1],
        head_dim_qk=case.dims[0],
        head_dim_v=case.dims[1],
        dtype=jnp.dtype(dtype),
        slack_q=case.slack[0],
        slack_kv=case.slack[1],
    )
    max_q, max_kv = case.max_seqlen or (batch.max_seqlen_q, batch.max_seqlen_kv)
    hq, dv = case.heads[0], case.dims[1]
    sinks = (2.0 * rng.standard_normal(hq)).astype(np.float32) if case.sinks else None
    tq = batch.q.shape[0]
    d_out = rng.standard_normal((tq, hq, dv)).astype(batch.q.dtype).astype(np.float64)
    d_stats = rng.standard_normal((tq, hq)).astype(np.float32).astype(np.float64)
    expected = reference_attention(
        *batch.reference_args,
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
        d_out=d_out,
        d_stats=d_stats,
        sinks=sinks,
        **case.options(),
    )

    def attention(q, k, v, sinks):
        return ragged_attention(
            q,
            k,
            v,
            batch.cu_seqlens_q,
            batch.cu_seqlens_kv,
            max_seqlen_q=max_q,
            max_seqlen_kv=max_kv,
            stats_layout=layout,
            return_stats=True,
            implementation="xla",
            sinks=sinks,
            xla_block_size=blocks,
            **case.options(),
        )

    def forward_and_vjp(primals, cotangent):
        outputs, vjp = jax.vjp(attention, *primals)
        return outputs, vjp(cotangent)

    stats_cotangent = d_stats if layout == "token_major" else d_stats.T
    cotangent = (jnp.asarray(d_out, batch.q.dtype), jnp.asarray(stats_cotangent, jnp.float32))
    primals = (batch.q, batch.k, batch.v, None if sinks is None else jnp.asarray(sinks))
    with backend_options(**private):
        (out, stats), grads = jax.jit(forward_and_vjp)(primals, cotangent)
    return batch, expected, out, stats if layout == "token_major" else stats.T, grads


def _check(batch, expected, out, stats, grads, dtype, what=""):
    assert out.dtype == batch.q.dtype and stats.dtype == jnp.float32
    assert_close(np.asarray(out, np.float64), expected["out"], dtype, f"{what}out")
    assert_close(np.asarray(stats, np.float64), expected["stats"], dtype, f"{what}stats")
    empty = np.isneginf(expected["stats"])  # padding rows and rows that attend nothing: exact
    np.testing.assert_array_equal(np.asarray(out, np.float64)[empty], 0.0, err_msg=f"{what}out of empty rows")
    np.testing.assert_array_equal(np.asarray(stats)[empty], -np.inf, err_msg=f"{what}stats of empty rows")
    for name, grad, like in zip(("dq", "dk", "dv"), grads, (batch.q, batch.k, batch.v)):
        assert grad.dtype == like.dtype, f"{what}{name} dtype {grad.dtype}"
        assert_close(np.asarray(grad, np.float64), expected[name], dtype, f"{what}{name}")
    empty_rows = empty.all(axis=1)
    np.testing.assert_array_equal(np.asarray(grads[0], np.float64)[empty_rows], 0.0, err_msg=f"{what}dq, empty rows")
    # Keys no query attends (padding, cut by max_seqlen, outside every band) get exactly 0.
    unread = np.all(expected["dk"] == 0, axis=(1, 2)) & np.all(expected["dv"] == 0, axis=(1, 2))
    assert unread[batch.padding_kv].all()
    for name, grad in (("dk", grads[1]), ("dv", grads[2])):
        np.testing.assert_array_equal(np.asarray(grad, np.float64)[unread], 0.0, err_msg=f"{what}{name} of unread keys")
    if "dsinks" in expected:
        # The sinks are float32, but their gradient sums <dO, out> over the op's output in the inputs' dtype
        # (the sink is an epilogue of the op's out and log-sum-exp, as on cuDNN): its rounding is the inputs'.
        assert_close(np.asarray(grads[3], np.float64), expected["dsinks"], dtype, f"{what}dsinks")


@pytest.fixture(autouse=True)
def _blocks_without_the_invalid_row_select(monkeypatch):
    """A sequence longer than max_seqlen is invalid input, whose rows the op reads NaN after the backend
    (ops/common.loud, tests/test_loud_rows.py). What this file tests is the block arithmetic for the rows the xla
    path is given, cut sequences included, so that select is left out here."""
    monkeypatch.setattr(common, "loud", lambda out, stats, rows, layout: (out, stats))


@pytest.mark.parametrize("case_name, dtype, blocks", PARAMS)
def test_small_blocks_match_the_reference(rng, case_name, dtype, blocks):
    case = CASES[case_name]
    layout = ("token_major", "head_major")[zlib.crc32(case_name.encode()) % 2]
    batch, expected, out, stats, grads = _run_case(rng, case, dtype, blocks, layout)
    _check(batch, expected, out, stats, grads, dtype, f"{layout} blocks {blocks}: ")


@pytest.mark.parametrize("case_name", list(CASES))
def test_the_two_pass_backward_matches_the_reference(rng, case_name):
    """The backward a GPU runs (a dQ pass and a dK/dV pass, no scatter-add), here on the CPU, whose default is
    the fused pass the other tests run."""
    blocks = BLOCKS[zlib.crc32(case_name.encode()) % len(BLOCKS)]
    batch, expected, out, stats, grads = _run_case(
        rng, CASES[case_name], "float32", blocks, "token_major", xla_fused_backward=False
    )
    _check(batch, expected, out, stats, grads, "float32", f"two passes, blocks {blocks}: ")


def test_the_fused_backward_is_the_cpu_default():
    batch = packed_batch(
        np.random.default_rng(0),
        (3,),
        (3,),
        num_heads_q=1,
        num_heads_kv=1,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=jnp.float32,
    )
    config = make_config(*batch.args, max_seqlen_q=3, max_seqlen_kv=3)
    assert xla_memory.fused_backward(config) == (jax.default_backend() == "cpu")
    with backend_options(xla_fused_backward=False):
        assert not xla_memory.fused_backward(config)
    with backend_options(xla_fused_backward=True):
        assert xla_memory.fused_backward(config)


@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients_are_bit_identical_run_to_run(deterministic):
    """The xla path's gradients are bit-identical run to run whatever `deterministic` says (on a GPU by its
    default two passes: no atomic scatter-add). Many sequences of several small tiles, so tiles of
    different lanes add into the same query rows."""
    rng = np.random.default_rng(zlib.crc32(b"deterministic"))
    lengths = (9, 14, 5, 11, 7, 13)
    batch = packed_batch(
        rng,
        lengths,
        lengths,
        num_heads_q=4,
        num_heads_kv=2,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=np.float32,
        slack_q=3,
        slack_kv=2,
    )

    @jax.jit
    def grads(q, k, v):
        def loss(q, k, v):
            out = ragged_attention(
                q,
                k,
                v,
                batch.cu_seqlens_q,
                batch.cu_seqlens_kv,
                max_seqlen_q=batch.max_seqlen_q,
                max_seqlen_kv=batch.max_seqlen_kv,
                is_causal=True,
                implementation="xla",
                deterministic=deterministic,
                xla_block_size=4,
            )
            return jnp.sum(out.astype(jnp.float32) * cotangent)

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    cotangent = jnp.asarray(rng.standard_normal(batch.q.shape), jnp.float32)
    first, second = grads(batch.q, batch.k, batch.v), grads(batch.q, batch.k, batch.v)
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _random_case(rng) -> Case:
    """Longer sequences than test_xla_path's draw, so small tiles make ranges of several steps."""
    num_seqs = int(rng.integers(1, 6))
    seqlens_q = random_lengths(rng, num_seqs, 0, 14)
    seqlens_kv = seqlens_q if rng.random() < 0.3 else random_lengths(rng, num_seqs, 0, 14)
    hkv = int(rng.choice([1, 2]))
    window = [None, None, int(rng.integers(0, 5)), (int(rng.integers(0, 5)), int(rng.integers(0, 5)))]
    return Case(
        seqlens_q,
        seqlens_kv,
        heads=(hkv * int(rng.choice([1, 2, 3])), hkv),
        dims=(int(rng.choice([4, 8])), int(rng.choice([4, 8, 12]))),
        is_causal=bool(rng.random() < 0.5),
        diagonal_alignment=str(rng.choice(["top_left", "bottom_right"])),
        local_window_size=window[int(rng.integers(len(window)))],
        slack=(int(rng.integers(0, 4)), int(rng.integers(0, 4))),
        sinks=bool(rng.random() < 0.3),
    )


@pytest.mark.parametrize("draw", range(6))
def test_random_configuration_and_blocks(rng, draw):
    """A failure message starts with the Case and blocks to paste."""
    case = _random_case(rng)
    blocks = (int(rng.integers(1, 7)), int(rng.integers(1, 7)))
    dtype = ("float32", "bfloat16")[draw % 2]
    layout = ("token_major", "head_major")[draw // 2 % 2]
    batch, expected, out, stats, grads = _run_case(rng, case, dtype, blocks, layout)
    _check(batch, expected, out, stats, grads, dtype, f"{case} blocks {blocks} {dtype} {layout}: ")


def test_block_size_changes_only_rounding(rng):
    """Tiles of 1, 3 and 128 rows give the same results to float32 rounding (the last is one tile)."""
    case = CASES["window_tuple_causal"]
    results = []
    for blocks in ((1, 1), (3, 3), (128, 128)):
        results.append(_run_case(np.random.default_rng(7), case, "float32", blocks, "token_major"))
    _, _, *base = results[0]
    for _, _, *other in results[1:]:
        pairs = [(other[0], base[0], "out"), (other[1], base[1], "stats")]
        pairs += list(zip(other[2][:3], base[2][:3], ("dq", "dk", "dv")))
        for got, want, name in pairs:
            assert_close(np.asarray(got, np.float64), np.asarray(want, np.float64), "float32", name)


def test_vmap_with_small_blocks(rng):
    """Two batches whose ranges need different numbers of steps, under one vmap: the while loop runs
    until the longer one is done and the shorter one's extra steps must change nothing."""
    batches = [
        packed_batch(
            rng,
            lengths,
            lengths,
            num_heads_q=2,
            num_heads_kv=1,
            head_dim_qk=8,
            head_dim_v=8,
            dtype=jnp.float32,
            slack_q=slack,
            slack_kv=slack,
        )
        for lengths, slack in (((3, 14, 0), 1), ((6, 5, 6), 1))
    ]
    max_len = 14

    def f(q, k, v, cu):
        return ragged_attention(
            q,
            k,
            v,
            cu,
            cu,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
            is_causal=True,
            stats_layout="token_major",
            return_stats=True,
            implementation="xla",
            xla_block_size=(2, 3),
        )

    stacked = [jnp.stack(parts) for parts in zip(*((b.q, b.k, b.v, b.cu_seqlens_q) for b in batches))]
    d_out = rng.standard_normal((2,) + batches[0].q.shape).astype(np.float32)
    d_stats = rng.standard_normal((2,) + batches[0].q.shape[:2]).astype(np.float32)

    def run(args, cotangent):
        outputs, vjp = jax.vjp(jax.vmap(f), *args)
        return outputs, vjp(cotangent)[:3]

    (out, stats), grads = jax.jit(run)(stacked, (jnp.asarray(d_out), jnp.asarray(d_stats)))
    for i, batch in enumerate(batches):
        expected = reference_attention(
            *batch.reference_args,
            max_seqlen_q=max_len,
            max_seqlen_kv=max_len,
            is_causal=True,
            d_out=d_out[i],
            d_stats=d_stats[i],
        )
        _check(batch, expected, out[i], stats[i], [g[i] for g in grads], "float32", f"batch {i}: ")


def test_block_setting_is_validated():
    batch = packed_batch(
        np.random.default_rng(0),
        (3,),
        (3,),
        num_heads_q=1,
        num_heads_kv=1,
        head_dim_qk=8,
        head_dim_v=8,
        dtype=jnp.float32,
    )
    call = functools.partial(ragged_attention, *batch.args, max_seqlen_q=3, max_seqlen_kv=3, implementation="xla")
    for bad in (0, "a", (1, 2, 3), -4, (2, 0), 1.5, True):
        with pytest.raises(ValueError, match="xla_block_size"):
            call(xla_block_size=bad)
    # A block larger than a capacity is capped at it; an int means both.
    config = make_config(*batch.args, AttentionOptions(xla_block_size=(2, 64)), max_seqlen_q=3, max_seqlen_kv=3)
    assert xla_memory.block_sizes(config) == (2, 3)
    assert AttentionOptions(xla_block_size=5).xla_block_size == (5, 5)
